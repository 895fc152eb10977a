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

{{/* What the operator does in a namespace it serves: least privilege, checked by the cluster tests. */}}
{{- define "capstan.namespacedRules" -}}
- apiGroups: [serving.capstan.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch, update]
- apiGroups: [serving.capstan.dev]
  resources: [inferenceservices/status]
  verbs: [get, patch, update]
- apiGroups: [serving.capstan.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, update]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, update]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, update]
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end -}}
