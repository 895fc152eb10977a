"""`capstan picker`: the Gateway API Inference Extension's Endpoint Picker, an Envoy ext_proc gRPC server that a
cluster's Gateway consults for each request to an InferencePool; it picks the pod with runtime/gateway's pool and
routing policy."""
