{{- define "kvkeeper.fullname" -}}
{{- printf "%s-kvkeeper" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvkeeper.vllm" -}}
{{- printf "%s-vllm" .Release.Name | trunc 55 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvkeeper.redis" -}}
{{- printf "%s-redis" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvkeeper.labels" -}}
app.kubernetes.io/name: kvkeeper
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvkeeper.selector" -}}
app.kubernetes.io/name: kvkeeper
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: proxy
{{- end -}}

{{- define "kvkeeper.vllmSelector" -}}
app.kubernetes.io/name: kvkeeper
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: vllm
{{- end -}}

{{- define "kvkeeper.redisSelector" -}}
app.kubernetes.io/name: kvkeeper
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end -}}

{{- define "kvkeeper.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvkeeper.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvkeeper.adminSecret" -}}
{{- default (printf "%s-admin" (include "kvkeeper.fullname" .)) .Values.adminToken.existingSecret -}}
{{- end -}}

{{- define "kvkeeper.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:6379/0" (include "kvkeeper.redis" .) -}}
{{- else -}}
{{- required "redis.url is required when redis.enabled is false" .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/* The restricted Pod Security Standard, for kvkeeper and Redis containers. */}}
{{- define "kvkeeper.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end -}}
