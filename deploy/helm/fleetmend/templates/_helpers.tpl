{{/* Common names and labels. */}}
{{- define "fleetmend.name" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "fleetmend.labels" -}}
app.kubernetes.io/name: fleetmend
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: include "fleetmend.selector" (list . "router") */}}
{{- define "fleetmend.selector" -}}
app.kubernetes.io/name: fleetmend
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* The control-plane image (router, worker, analyzer, setup Job): Dockerfile target control-plane. */}}
{{- define "fleetmend.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The agent's image: Dockerfile target agent (no Temporal, no Kubernetes client). */}}
{{- define "fleetmend.agentImage" -}}
{{ .Values.agent.image.repository }}:{{ .Values.agent.image.tag | default .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Environment every fleetmend process shares. */}}
{{- define "fleetmend.env" -}}
- name: FLEETMEND_CLUSTER
  value: {{ .Values.cluster | quote }}
- name: FLEETMEND_NATS_URL
  value: {{ .Values.nats.url | quote }}
- name: FLEETMEND_TEMPORAL_ADDRESS
  value: {{ .Values.temporal.address | quote }}
- name: FLEETMEND_TEMPORAL_NAMESPACE
  value: {{ .Values.temporal.namespace | quote }}
- name: FLEETMEND_CONFIG
  value: /etc/fleetmend/fleetmend.toml
- name: FLEETMEND_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- end -}}

{{/* Probes on a role's metrics port (/healthz: event loop alive; /readyz: connected and serving). */}}
{{- define "fleetmend.probes" -}}
livenessProbe:
  httpGet: {path: /healthz, port: metrics}
  initialDelaySeconds: 10
  periodSeconds: 10
  failureThreshold: 6
readinessProbe:
  httpGet: {path: /readyz, port: metrics}
  periodSeconds: 5
  failureThreshold: 3
{{- end -}}

{{- define "fleetmend.restrictedSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities: {drop: ["ALL"]}
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- define "fleetmend.checkCluster" -}}
{{- if not (regexMatch "^[A-Za-z0-9_-]{1,128}$" .Values.cluster) -}}
{{- fail (printf "cluster %q: use letters, digits, '-' and '_' only (it is a NATS subject token)" .Values.cluster) -}}
{{- end -}}
{{- end -}}
