{{- define "capstan.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "capstan.labels" -}}
app.kubernetes.io/name: capstan-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "capstan.selectorLabels" -}}
app.kubernetes.io/name: capstan-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "capstan.serviceAccountName" -}}
{{- default (include "capstan.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "capstan.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Exactly what the operator does in a namespace it serves; the cluster tests run it under these rules. */}}
{{- define "capstan.namespacedRules" -}}
- apiGroups: [serving.capstan.dev]
  resources: [inferenceservices]
  verbs: [list, watch, patch]  # kopf watches them and keeps its bookkeeping in annotations
- apiGroups: [serving.capstan.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
- apiGroups: [serving.capstan.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]  # owner references that block deletion, where OwnerReferencesPermissionEnforcement is on
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [get, list, create, patch, delete]  # server-side apply; delete what the spec no longer renders
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [list, create, patch, delete]  # multi-host replicas, where the cluster serves LeaderWorkerSet
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch]
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, create, patch, delete]  # the model cache claim it creates, and removes when no longer asked for
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch, delete]  # the adapters' list the pods mount (spec.adapters), removed with LoRA off
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, delete]  # status and autoscaling read the pods; a multi-host group is replaced as a whole; get, watch: granted to endpoint pickers
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch, delete]  # spec.inferencePool; get, list, watch: granted to its picker
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch, delete]  # the endpoint picker's identity
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch, delete]  # the picker's Role grants only rights the operator holds itself (above)
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, watch, patch]
{{- end -}}

{{- define "capstan.gatewayLabels" -}}
app.kubernetes.io/name: capstan-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "capstan.gatewaySelectorLabels" -}}
app.kubernetes.io/name: capstan-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The gateway's in-cluster OpenAI base URL, reported in every InferenceService's status.url. */}}
{{- define "capstan.gatewayURL" -}}
{{- $name := printf "%s-gateway" (include "capstan.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- $port := int .Values.gateway.service.port -}}
{{- $scheme := ternary "https" "http" (ne .Values.gateway.tls.secretName "") -}}
{{- $default := ternary 443 80 (ne .Values.gateway.tls.secretName "") -}}
{{- printf "%s://%s.%s.svc.cluster.local%s/v1" $scheme $name .Release.Namespace (ternary "" (printf ":%d" $port) (eq $port $default)) -}}
{{- end -}}
