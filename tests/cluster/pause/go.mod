module capstan.dev/testcluster/pause

go 1.26
