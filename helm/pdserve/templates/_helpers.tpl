{{/* Names and labels. */}}
{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pdserve.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The Redis URL every component uses: the external one, the chart's, or none. */}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.externalUrl -}}
{{- .Values.redis.externalUrl -}}
{{- else if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:6379/0" (include "pdserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{/* Volumes every pdserve pod mounts: the deployment file, writable scratch (the root
filesystem is read-only), the kernel cache, and the model volume when given. */}}
{{- define "pdserve.volumes" -}}
- name: config
  configMap:
    name: {{ include "pdserve.fullname" . }}-config
- name: tmp
  emptyDir: {}
- name: kernels
  emptyDir: {}
{{- if .Values.modelVolume }}
- name: model
{{ toYaml .Values.modelVolume | indent 2 }}
{{- end }}
{{- end -}}

{{- define "pdserve.volumeMounts" -}}
- name: config
  mountPath: /etc/pdserve
  readOnly: true
- name: tmp
  mountPath: /tmp
- name: kernels
  mountPath: /opt/pdserve/cache/kernels
{{- if .Values.modelVolume }}
- name: model
  mountPath: {{ .Values.modelMountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pdserve.env" -}}
- name: PDSERVE_CACHE_DIR
  value: /opt/pdserve/cache
- name: HOME
  value: /tmp
- name: TOKENIZERS_PARALLELISM
  value: "false"
{{- end -}}

{{/* Rules a JSON schema cannot say clearly: checked once, with what to change. */}}
{{- define "pdserve.validate" -}}
{{- $p := .Values.pools -}}
{{- if ne (gt (int $p.prefill.replicas) 0) (gt (int $p.decode.replicas) 0) -}}
{{- fail (printf "pools: prefill.replicas=%v and decode.replicas=%v: a disaggregated deployment needs both pools (>= 1 each), or neither (then use pools.mixed.replicas)" $p.prefill.replicas $p.decode.replicas) -}}
{{- end -}}
{{- if eq (add (int $p.prefill.replicas) (int $p.mixed.replicas)) 0 -}}
{{- fail "pools: no workers: set pools.prefill.replicas and pools.decode.replicas (>= 1 each), or pools.mixed.replicas" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) (not .Values.redis.externalUrl) -}}
{{- fail "redis: routers find workers through the Redis registry (and share the prefix index there): keep redis.enabled=true or set redis.externalUrl=redis://HOST:PORT/DB" -}}
{{- end -}}
{{- range $role, $pool := $p -}}
{{- if and $pool.autoscaling.enabled (lt (int $pool.autoscaling.maxReplicas) (int $pool.autoscaling.minReplicas)) -}}
{{- fail (printf "pools.%s.autoscaling: maxReplicas (%v) < minReplicas (%v)" $role $pool.autoscaling.maxReplicas $pool.autoscaling.minReplicas) -}}
{{- end -}}
{{- end -}}
{{- end -}}
