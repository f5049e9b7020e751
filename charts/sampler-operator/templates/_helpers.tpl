{{- define "sampler-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sampler-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sampler-operator.labels" -}}
app.kubernetes.io/name: {{ include "sampler-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "sampler-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sampler-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sampler-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sampler-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Namespaces watched when not cluster-wide: the listed ones, else the release namespace. */}}
{{- define "sampler-operator.watchNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- join "," .Values.watch.namespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* Rules needed in every namespace holding SamplerReplicas. */}}
{{- define "sampler-operator.namespacedRules" -}}
# the custom resources: watch them, write kopf's finalizer/annotations, and the status subresource;
# a pool creates, rolls and deletes the SamplerReplicas it owns
- apiGroups: [sampler.rl.dev]
  resources: [samplerreplicas]
  verbs: [get, list, watch, patch, create, delete]
# SamplerPools: watch them, kopf's annotations, their status; they own SamplerReplicas
- apiGroups: [sampler.rl.dev]
  resources: [samplerpools]
  verbs: [get, list, watch, patch]
- apiGroups: [sampler.rl.dev]
  resources: [samplerpools/status]
  verbs: [get, patch]
- apiGroups: [sampler.rl.dev]
  resources: [samplerpools/finalizers]
  verbs: [update]
- apiGroups: [sampler.rl.dev]
  resources: [samplerreplicas/status]
  verbs: [get, patch]
# ownerReferences with blockOwnerDeletion need update on the owner's finalizers
- apiGroups: [sampler.rl.dev]
  resources: [samplerreplicas/finalizers]
  verbs: [update]
# the sampler pods: create, replace, adopt (patch ownerReferences), watch
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete, patch]
# the replicas' keys: `create` for the Secret the operator generates per replica when the spec names
# none (created if absent, never updated), `get` to read the admin key for its in-place loads.
# No list/watch/update/delete: it never sees the namespace's other secrets or rewrites one
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# a SamplerPool's gateway: its Deployment and Service, and the ServiceAccount, Role and RoleBinding
# its discovery uses (the Role grants only get/list/watch this Role holds itself: no escalation)
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch]
# the NetworkPolicies of pools and lone replicas (deleted when a CR or the chart turns them off)
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [get, create, patch]
# the pool's gateways acknowledge its routing switch in Leases: `list` to read them, `watch` to open
# a fence on the last acknowledgement, `delete` for those of gateway pods long gone; get/create/update
# because the gateway's Role grants them
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, list, watch, create, update, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch]
# Events explaining replacements (kopf posts core/v1 events)
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{- /* The operator's image (also the default image of pools' gateways: it carries sampler_gateway). */ -}}
{{- define "sampler-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
