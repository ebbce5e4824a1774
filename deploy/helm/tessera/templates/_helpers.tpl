{{/* Names, labels and the pieces every pool's objects share. */}}

{{- define "tessera.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name; pool objects append "-<pool>" (so it is cut to leave room). */}}
{{- define "tessera.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 48 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tessera.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The pools, in request order. */}}
{{- define "tessera.pools" -}}
router encoder prefill decode
{{- end -}}

{{- define "tessera.workerPools" -}}
encoder prefill decode
{{- end -}}

{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tessera.labels" -}}
helm.sh/chart: {{ include "tessera.chart" . }}
{{ include "tessera.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tessera
{{- end -}}

{{/* Called with (dict "root" $ "pool" "prefill"). */}}
{{- define "tessera.poolSelectorLabels" -}}
{{ include "tessera.selectorLabels" .root }}
app.kubernetes.io/component: {{ .pool }}
{{- end -}}

{{- define "tessera.poolLabels" -}}
{{ include "tessera.labels" .root }}
app.kubernetes.io/component: {{ .pool }}
{{- end -}}

{{- define "tessera.poolName" -}}
{{- printf "%s-%s" (include "tessera.fullname" .root) .pool -}}
{{- end -}}

{{- define "tessera.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "tessera.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tessera.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tessera.configName" -}}
{{- printf "%s-engine" (include "tessera.fullname" .) -}}
{{- end -}}

{{- define "tessera.clusterName" -}}
{{- default .Release.Name .Values.cluster -}}
{{- end -}}

{{/* Where the checkpoint directory is inside every container. */}}
{{- define "tessera.modelPath" -}}
{{- $m := .Values.model -}}
{{- $dir := $m.dir -}}
{{- if and (not $m.existingClaim) (not $m.hostPath) (not $dir) -}}
{{- $dir = printf "demo-%s" $m.demo.preset -}}
{{- end -}}
{{- if $dir -}}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimPrefix "/" $dir) -}}
{{- else -}}
{{- $m.mountPath -}}
{{- end -}}
{{- end -}}

{{- define "tessera.demoModel" -}}
{{- and (not .Values.model.existingClaim) (not .Values.model.hostPath) -}}
{{- end -}}

{{/* The auth Secret's name and key. */}}
{{- define "tessera.authSecretName" -}}
{{- default (printf "%s-auth" (include "tessera.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "tessera.authSecretKey" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecretKey -}}
{{- else -}}
auth-secret
{{- end -}}
{{- end -}}

{{/* etcd endpoints, comma-separated, as --etcd / TESSERA_ETCD take them. */}}
{{- define "tessera.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- $name := printf "%s-etcd" (include "tessera.fullname" .) -}}
{{- $ns := .Release.Namespace -}}
{{- $port := int .Values.etcd.clientPort -}}
{{- if eq (int .Values.etcd.replicaCount) 1 -}}
{{- printf "%s.%s.svc:%d" $name $ns $port -}}
{{- else -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicaCount) -}}
{{- $eps = append $eps (printf "%s-%d.%s-headless.%s.svc:%d" $name $i $name $ns $port) -}}
{{- end -}}
{{- join "," $eps -}}
{{- end -}}
{{- else -}}
{{- join "," .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{/* Fails rendering on combinations that cannot work. */}}
{{- define "tessera.validate" -}}
{{- if and (not .Values.etcd.enabled) (not .Values.etcd.endpoints) -}}
{{- fail "discovery needs etcd: set etcd.enabled=true or list etcd.endpoints" -}}
{{- end -}}
{{- if and .Values.etcd.enabled .Values.etcd.endpoints -}}
{{- fail "set either etcd.enabled or etcd.endpoints, not both" -}}
{{- end -}}
{{- if and .Values.model.existingClaim .Values.model.hostPath -}}
{{- fail "set either model.existingClaim or model.hostPath, not both" -}}
{{- end -}}
{{- if and .Values.router.enabled (or (not .Values.prefill.enabled) (not .Values.decode.enabled)) -}}
{{- fail "the router needs the prefill and decode pools (prefill.enabled and decode.enabled)" -}}
{{- end -}}
{{- range $pool := splitList " " (include "tessera.pools" .) -}}
{{- $v := index $.Values $pool -}}
{{- if and $v.autoscaling.enabled (lt (int $v.autoscaling.maxReplicas) (int $v.autoscaling.minReplicas)) -}}
{{- fail (printf "%s.autoscaling.maxReplicas is below minReplicas" $pool) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Volumes every pod mounts: the model (read-only), /tmp, and /dev/shm for workers. */}}
{{- define "tessera.volumes" -}}
{{- $root := .root -}}
{{- $v := .values -}}
- name: model
{{- if $root.Values.model.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ $root.Values.model.existingClaim }}
    readOnly: true
{{- else if $root.Values.model.hostPath }}
  hostPath:
    path: {{ $root.Values.model.hostPath }}
    type: Directory
{{- else }}
  emptyDir: {}
{{- end }}
- name: tmp
  emptyDir: {}
{{- if and (ne .pool "router") $v.shmSize }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.shmSize }}
{{- end }}
{{- end -}}

{{- define "tessera.volumeMounts" -}}
- name: model
  mountPath: {{ .root.Values.model.mountPath }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if and (ne .pool "router") .values.shmSize }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- end -}}

{{/* Environment every Tessera container gets besides the ConfigMap. */}}
{{- define "tessera.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: TESSERA_ETCD
  value: {{ include "tessera.etcdEndpoints" .root | quote }}
- name: TESSERA_CLUSTER
  value: {{ include "tessera.clusterName" .root | quote }}
- name: TESSERA_AUTH_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "tessera.authSecretName" .root }}
      key: {{ include "tessera.authSecretKey" .root }}
- name: HOME
  value: /tmp
{{- end -}}
