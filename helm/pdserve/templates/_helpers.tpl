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

{{/* The Redis URL every component uses: the external one (with its CA's path when
redis.tls.caSecret is set), the chart's, or none. Never a password: that comes from the
Secret (pdserve.redisSecret), as $PDSERVE_REDIS_PASSWORD. */}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.externalUrl -}}
{{- .Values.redis.externalUrl -}}
{{- if .Values.redis.tls.caSecret -}}
{{- ternary "&" "?" (contains "?" .Values.redis.externalUrl) -}}ssl_ca_certs={{ include "pdserve.secretDir" "redis-ca" }}/ca.pem
{{- end -}}
{{- else if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:6379/0" (include "pdserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the Redis password: the user's, the chart's own (its Redis
always has one), or "" (an external Redis without a password). */}}
{{- define "pdserve.redisSecret" -}}
{{- if .Values.redis.auth.existingSecret -}}
{{- .Values.redis.auth.existingSecret -}}
{{- else if and .Values.redis.enabled (not .Values.redis.externalUrl) -}}
{{- include "pdserve.fullname" . }}-redis
{{- end -}}
{{- end -}}

{{- define "pdserve.rayTokenSecret" -}}
{{- .Values.kuberay.auth.existingSecret | default (printf "%s-ray-token" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* Where a trust Secret is mounted (its name: cluster-tls, router-tls, api-keys,
cluster-secret, redis-ca). */}}
{{- define "pdserve.secretDir" -}}
/var/run/secrets/pdserve/{{ . }}
{{- end -}}

{{/* A random secret that survives upgrades: the value already in Secret `name` (key
`key`), else a new one. Base64, ready for `data:`. */}}
{{- define "pdserve.keptSecret" -}}
{{- $old := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- if and $old (hasKey ($old.data | default dict) .key) -}}
{{- index $old.data .key -}}
{{- else -}}
{{- randAlphaNum .length | b64enc -}}
{{- end -}}
{{- end -}}

{{/* The trust Secrets a component mounts: `for` is router, worker or ray (the Ray
head: `pdserve up` checks them all, and the router actor runs there; Ray worker pods
host workers only). `part`: volumes or mounts. */}}
{{- define "pdserve.secretMounts" -}}
{{- $v := .root.Values -}}
{{- $router := or (eq .for "router") (eq .for "ray") -}}
{{- $worker := or (eq .for "worker") (eq .for "ray") -}}
{{- $m := list -}}
{{- if $v.tls.cluster.secretName -}}{{- $m = append $m (list "cluster-tls" $v.tls.cluster.secretName "") -}}{{- end -}}
{{- if and $router $v.tls.router.secretName -}}{{- $m = append $m (list "router-tls" $v.tls.router.secretName "") -}}{{- end -}}
{{- if and $router $v.apiKeys.secretName -}}{{- $m = append $m (list "api-keys" $v.apiKeys.secretName $v.apiKeys.key "keys") -}}{{- end -}}
{{- if and $worker $v.clusterSecret.secretName -}}{{- $m = append $m (list "cluster-secret" $v.clusterSecret.secretName $v.clusterSecret.key "secret") -}}{{- end -}}
{{- if and $v.redis.externalUrl $v.redis.tls.caSecret -}}{{- $m = append $m (list "redis-ca" $v.redis.tls.caSecret $v.redis.tls.caKey "ca.pem") -}}{{- end -}}
{{- if eq .part "volumes" -}}
{{- range $m }}
- name: {{ index . 0 }}
  secret:
    secretName: {{ index . 1 }}
    defaultMode: 288  # 0440: the pod's group (fsGroup) reads it, no one else
    {{- if index . 2 }}
    items:
      - {key: {{ index . 2 }}, path: {{ index . 3 }}}
    {{- end }}
{{- end }}
{{- else -}}
{{- range $m }}
- name: {{ index . 0 }}
  mountPath: {{ include "pdserve.secretDir" (index . 0) }}
  readOnly: true
{{- end }}
{{- end -}}
{{- end -}}

{{/* Ingress rules of the router's pod: gRPC and HTTP from networkPolicy.routerFrom
(none given: from anywhere), /metrics from networkPolicy.metricsFrom. */}}
{{- define "pdserve.routerIngress" -}}
- ports:
    - {port: {{ .Values.router.grpcPort }}, protocol: TCP}
    - {port: {{ .Values.router.httpPort }}, protocol: TCP}
  {{- with .Values.networkPolicy.routerFrom }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
- ports:
    - {port: {{ .Values.router.metricsPort }}, protocol: TCP}
  {{- with .Values.networkPolicy.metricsFrom }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* A probe of a gRPC port: kubelet's gRPC health check, which speaks plaintext only;
when the port serves TLS (`tls` set), whether it accepts connections. */}}
{{- define "pdserve.probe" -}}
{{- if .tls -}}
tcpSocket: {port: {{ .port }}}
{{- else -}}
grpc: {port: {{ .port }}}
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
{{- with include "pdserve.redisSecret" . }}
- name: PDSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ . }}, key: {{ $.Values.redis.auth.secretKey }}}
{{- end }}
{{- end -}}

{{/* Ray's token authentication, on every Ray pod (KubeRay's documented manual mode). */}}
{{- define "pdserve.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "pdserve.rayTokenSecret" . }}, key: {{ .Values.kuberay.auth.secretKey }}}
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
{{- if regexMatch "^rediss?://[^/@]*:[^/@]*@" .Values.redis.externalUrl -}}
{{- fail "redis.externalUrl carries a password, which would land in the ConfigMap and every command line: drop it from the URL and put it in a Secret named by redis.auth.existingSecret (key redis.auth.secretKey)" -}}
{{- end -}}
{{- if and .Values.redis.tls.caSecret (not (hasPrefix "rediss://" .Values.redis.externalUrl)) -}}
{{- fail "redis.tls.caSecret: only for an external Redis over TLS; set redis.externalUrl=rediss://HOST:PORT/DB" -}}
{{- end -}}
{{- if and .Values.tls.router.caKey (not .Values.tls.router.secretName) -}}
{{- fail "tls.router.caKey names a key of tls.router.secretName: set tls.router.secretName too" -}}
{{- end -}}
{{- if and .Values.kuberay.enabled .Values.tls.router.secretName (not .Values.tls.router.caKey) (not .Values.tls.cluster.secretName) -}}
{{- fail "tls.router.secretName with kuberay.enabled: `pdserve up` checks the router's certificate, so set tls.router.caKey (the CA in that Secret, cert-manager: ca.crt) or tls.cluster.secretName" -}}
{{- end -}}
{{- range $role, $pool := $p -}}
{{- if and $pool.autoscaling.enabled (lt (int $pool.autoscaling.maxReplicas) (int $pool.autoscaling.minReplicas)) -}}
{{- fail (printf "pools.%s.autoscaling: maxReplicas (%v) < minReplicas (%v)" $role $pool.autoscaling.maxReplicas $pool.autoscaling.minReplicas) -}}
{{- end -}}
{{- end -}}
{{- end -}}
