{{/* Common names and labels. fullnameOverride replaces the release name in object names. */}}
{{- define "fleetmend.name" -}}
{{- .Values.fullnameOverride | default .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* app.kubernetes.io/name: nameOverride or fleetmend (part of every selector: set it once, at install). */}}
{{- define "fleetmend.appName" -}}
{{- .Values.nameOverride | default "fleetmend" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fleetmend.labels" -}}
app.kubernetes.io/name: {{ include "fleetmend.appName" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: include "fleetmend.selector" (list . "router") */}}
{{- define "fleetmend.selector" -}}
app.kubernetes.io/name: {{ include "fleetmend.appName" (index . 0) }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Pod labels and annotations of one component: include "fleetmend.podMeta" (list . "router" .Values.router)
     selector labels + podLabels (chart-wide, then the component's); config checksum + podAnnotations. */}}
{{- define "fleetmend.podMeta" -}}
{{- $root := index . 0 -}}{{- $v := index . 2 -}}
labels:
  {{- include "fleetmend.selector" (list $root (index . 1)) | nindent 2 }}
  {{- with (merge (deepCopy ($v.podLabels | default dict)) (deepCopy ($root.Values.podLabels | default dict))) }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
annotations:
  checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
  {{- with (merge (deepCopy ($v.podAnnotations | default dict)) (deepCopy ($root.Values.podAnnotations | default dict))) }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* image@digest when a digest is given, else image:tag (tag defaults to the chart's appVersion). */}}
{{- define "fleetmend.imageRef" -}}
{{- $img := index . 0 -}}{{- $tag := index . 1 -}}
{{- if $img.digest -}}
{{ $img.repository }}@{{ $img.digest }}
{{- else -}}
{{ $img.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{/* The control-plane image (router, worker, analyzer, setup Job): Dockerfile target control-plane. */}}
{{- define "fleetmend.image" -}}
{{ include "fleetmend.imageRef" (list .Values.image (.Values.image.tag | default .Chart.AppVersion)) }}
{{- end -}}

{{/* The agent's image: Dockerfile target agent (no Temporal, no Kubernetes client). */}}
{{- define "fleetmend.agentImage" -}}
{{ include "fleetmend.imageRef" (list .Values.agent.image (.Values.agent.image.tag | default .Values.image.tag | default .Chart.AppVersion)) }}
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
{{- include "fleetmend.tlsEnv" (list "NATS" .Values.nats.tls "nats") }}
{{- end -}}

{{/* TLS settings of one client from a Secret mounted at /etc/fleetmend/tls/<dir> (cert-manager's keys:
     ca.crt, and tls.crt/tls.key for mutual TLS): include "fleetmend.tlsEnv" (list "NATS" .Values.nats.tls "nats") */}}
{{- define "fleetmend.tlsEnv" -}}
{{- $p := index . 0 -}}{{- $t := index . 1 -}}{{- $dir := index . 2 -}}
{{- if $t.enabled }}
- name: FLEETMEND_{{ $p }}_TLS__ENABLED
  value: "true"
{{- if $t.serverName }}
- name: FLEETMEND_{{ $p }}_TLS__SERVER_NAME
  value: {{ $t.serverName | quote }}
{{- end }}
{{- if $t.secretName }}
- name: FLEETMEND_{{ $p }}_TLS__CA_FILE
  value: /etc/fleetmend/tls/{{ $dir }}/ca.crt
{{- if $t.mutual }}
- name: FLEETMEND_{{ $p }}_TLS__CERT_FILE
  value: /etc/fleetmend/tls/{{ $dir }}/tls.crt
- name: FLEETMEND_{{ $p }}_TLS__KEY_FILE
  value: /etc/fleetmend/tls/{{ $dir }}/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* volumeMounts / volumes of the TLS Secrets: include "fleetmend.tlsMounts" (list . true) (true: Temporal too) */}}
{{- define "fleetmend.tlsMounts" -}}
{{- $root := index . 0 -}}
{{- $tls := list (list "nats" $root.Values.nats.tls) -}}
{{- if index . 1 }}{{- $tls = append $tls (list "temporal" $root.Values.temporal.tls) -}}{{- end }}
{{- range $tls }}
{{- if and (index . 1).enabled (index . 1).secretName }}
- {name: tls-{{ index . 0 }}, mountPath: /etc/fleetmend/tls/{{ index . 0 }}, readOnly: true}
{{- end }}
{{- end }}
{{- end -}}

{{- define "fleetmend.tlsVolumes" -}}
{{- $root := index . 0 -}}
{{- $tls := list (list "nats" $root.Values.nats.tls) -}}
{{- if index . 1 }}{{- $tls = append $tls (list "temporal" $root.Values.temporal.tls) -}}{{- end }}
{{- range $tls }}
{{- if and (index . 1).enabled (index . 1).secretName }}
- name: tls-{{ index . 0 }}
  secret: {secretName: {{ (index . 1).secretName }}, defaultMode: 0440}
{{- end }}
{{- end }}
{{- end -}}

{{/* Scheduling of a control-plane Deployment: include "fleetmend.scheduling" (list . "worker" .Values.worker)
     affinity: the component's own, else (controlPlane.avoidGpuNodes) never on a GPU node (the nodes
     fleetmend drains: its own drain must not evict its worker or router) and spread over hosts;
     topologySpreadConstraints: the component's own, else spread over zones and hosts (best effort). */}}
{{- define "fleetmend.scheduling" -}}
{{- $root := index . 0 -}}{{- $name := index . 1 -}}{{- $v := index . 2 -}}
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- if $v.affinity }}
affinity: {{- toYaml $v.affinity | nindent 2 }}
{{- else }}
affinity:
  {{- if $root.Values.controlPlane.avoidGpuNodes }}
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            - {key: {{ $root.Values.controlPlane.gpuNodeLabel }}, operator: NotIn, values: ["true"]}
  {{- end }}
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "fleetmend.selector" (list $root $name) | nindent 14 }}
{{- end }}
{{- if $v.topologySpreadConstraints }}
topologySpreadConstraints: {{- toYaml $v.topologySpreadConstraints | nindent 2 }}
{{- else }}
topologySpreadConstraints:
  - maxSkew: 1
    topologyKey: topology.kubernetes.io/zone
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "fleetmend.selector" (list $root $name) | nindent 8 }}
{{- end }}
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

{{/* Annotations of every ServiceAccount the chart creates (e.g. a cloud workload identity). */}}
{{- define "fleetmend.saAnnotations" -}}
{{- with .Values.serviceAccount.annotations }}
annotations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
