"""The InferenceService resource (serving.capstan.dev/v1alpha1): the one source of the CRD schema.

Field names are the YAML's camelCase; `x-kubernetes-validations` carry the CEL rules that the API
server checks, so a nonsensical spec is refused at `kubectl apply` with a message naming the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from capstan.operator.accelerators import ACCELERATORS
from capstan.operator.model_source import served_model_name

GROUP = "serving.capstan.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["csvc"]  # KServe owns `isvc`
# The gateway's demand signal (docs/gateway.md): seconds since the epoch of a recent request for the model, refreshed
# at most every DEMAND_REFRESH_SECONDS while requests arrive. It scales a service at minReplicas 0 up from zero.
DEMAND_ANNOTATION = f"{GROUP}/last-request-time"
DEMAND_REFRESH_SECONDS = 10

# hf://org/name[@revision], pvc://claim[/path], gs://bucket[/path], s3://bucket[/path]
MODEL_URI_PATTERN = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+(@[A-Za-z0-9_./-]+)?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?"
    r"|gs://[a-z0-9][a-z0-9._-]*[a-z0-9](/[^\s]*)?"
    r"|s3://[a-z0-9][a-z0-9.-]*[a-z0-9](/[^\s]*)?)$"
)
MAX_ADAPTERS = 128
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"

if TYPE_CHECKING:  # the names come from accelerators.py when the module runs; a type checker sees a str
    AcceleratorType = str
else:
    AcceleratorType = Literal[tuple(ACCELERATORS)]


def _cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    validation: JsonDict = {"rule": rule, "message": message}
    if field_path:
        validation["fieldPath"] = field_path
    return validation


class _Resource(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class ModelSpec(_Resource):
    """Which checkpoint to serve and under which name."""

    uri: str = Field(
        pattern=MODEL_URI_PATTERN,
        max_length=1024,
        description="hf://org/name[@revision], pvc://claim/path, gs://bucket/path or s3://bucket/path",
    )
    served_name: str | None = Field(
        None, max_length=256, description="model name clients send (default: the URI's name)"
    )
    tokenizer: str | None = Field(None, max_length=1024, description="tokenizer to use instead of the checkpoint's")


ADAPTER_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"  # no '/': never an hf:// model id


class AdapterSpec(_Resource):
    """A LoRA adapter of the base model, served under its own name beside it."""

    name: str = Field(
        pattern=ADAPTER_NAME_PATTERN,
        max_length=63,
        description="the `model` clients send to use it: lowercase letters, digits, '-', '_' and '.'",
    )
    source: str = Field(
        pattern=MODEL_URI_PATTERN,
        max_length=1024,
        description="a PEFT adapter folder: hf://org/name[@revision], pvc://claim/path, gs://bucket/path or "
        "s3://bucket/path",
    )


class LoraSpec(_Resource):
    """Multi-LoRA serving settings (`capstan serve --enable-lora`); unset fields take the runtime's defaults."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.maxLoras) || !has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras",
                    "spec.lora.maxCpuLoras must be at least spec.lora.maxLoras (adapters on the device are also"
                    " kept in host memory)",
                    ".maxCpuLoras",
                ),
            ]
        }
    )

    max_loras: int | None = Field(None, ge=1, le=256, description="adapters on the device at once (--max-loras)")
    max_lora_rank: int | None = Field(None, ge=1, le=512, description="largest adapter rank r (--max-lora-rank)")
    max_cpu_loras: int | None = Field(
        None, ge=1, le=4096, description="adapters kept in host memory, swapped onto the device in LRU order"
    )


class RuntimeSpec(_Resource):
    """Engine settings, passed to `capstan serve` as its flags."""

    max_model_len: int | None = Field(None, ge=16, le=1048576, description="longest prompt + completion, in tokens")
    max_num_seqs: int | None = Field(None, ge=1, le=4096, description="sequences in one running batch")
    page_size: int | None = Field(None, ge=1, le=1024, description="tokens per KV-cache page")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    extra_args: list[str] = Field(default_factory=list, max_length=64, description="appended to `capstan serve`")


def _tpu_host_chips_rule() -> JsonDict:
    """accelerator.count of a TPU type must be the chips of one of its hosts (from accelerators.py)."""
    chips = {name: list(a.host_chips) for name, a in ACCELERATORS.items() if a.host_chips}
    table = "{" + ", ".join(f"'{name}': {values}" for name, values in chips.items()) + "}"
    allowed = "; ".join(f"{name}: {', '.join(map(str, values))}" for name, values in chips.items())
    return _cel(
        f"!(self.type in {table}) || self.count in {table}[self.type]",
        f"accelerator.count is the chips of one TPU host: {allowed}",
        ".count",
    )


class AcceleratorSpec(_Resource):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!self.type.startsWith('tpu-') || has(self.topology)",
                    "accelerator.topology is required for TPU accelerators (for example 2x4)",
                    ".topology",
                ),
                _cel(
                    "self.type.startsWith('tpu-') || !has(self.topology)",
                    "accelerator.topology applies to TPU accelerators only",
                    ".topology",
                ),
                _tpu_host_chips_rule(),
            ]
        }
    )

    type: AcceleratorType = Field("cpu", description="cpu, an NVIDIA GPU type or a TPU type")
    count: int = Field(1, ge=1, le=64, description="devices per host (pod); a replica has parallelism.hosts of them")
    topology: str | None = Field(
        None,
        pattern=r"^[1-9][0-9]?x[1-9][0-9]?(x[1-9][0-9]?)?$",
        max_length=8,
        description="TPU slice topology: its chips are parallelism.hosts x count",
    )


class ParallelismSpec(_Resource):
    """How one replica spreads over devices and hosts; more than one host makes the replica a group of pods
    that `jax.distributed` joins into one program (a TPU slice, or GPUs on several nodes)."""

    tensor: int | None = Field(
        None,
        ge=1,
        le=512,
        description="devices the weights are sharded over "
        "(--tensor-parallel-size); default: all of a replica's devices when hosts > 1",
    )
    hosts: int = Field(1, ge=1, le=64, description="hosts (pods) per replica; process 0 serves HTTP")
    data: int = Field(
        1,
        ge=1,
        le=64,
        description="engine replicas in each pod, each on its own parallelism.tensor "
        "GPUs, behind one endpoint (--data-parallel-size): a model that fits one GPU on a pod of several",
    )


class AutoscalingSpec(_Resource):
    """Scale on the pods' own load, smoothed so that replicas do not flap."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.metric != 'kvCacheUsage' || self.target <= 1.0",
                    "autoscaling.target is a ratio between 0 and 1 for the kvCacheUsage metric",
                    ".target",
                ),
            ]
        }
    )

    metric: Literal["concurrentRequests", "kvCacheUsage"] = Field(
        "concurrentRequests",
        description="concurrentRequests: running + waiting per replica; kvCacheUsage: used pages ratio",
    )
    target: float = Field(gt=0, description="the metric's value per replica to aim for")
    scale_up_stabilization_seconds: int = Field(0, ge=0, le=3600)
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=86400)


class SecretKeySelector(_Resource):
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253)


class ModelCacheSpec(_Resource):
    """A volume for downloaded weights and compilation caches, so that restarts do not download again."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "has(self.claimName) != has(self.size)",
                    "modelCache needs exactly one of claimName (an existing PVC) or size (a PVC the operator creates)",
                ),
            ]
        }
    )

    claim_name: str | None = Field(None, pattern=DNS_LABEL_PATTERN, max_length=253)
    size: str | None = Field(None, pattern=QUANTITY_PATTERN, description="for example 100Gi")
    storage_class_name: str | None = Field(None, max_length=253)
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"] = "ReadWriteMany"


class SecuritySpec(_Resource):
    """Every serving pod passes the `restricted` Pod Security Standard unless this asks for more."""

    privileged: bool = Field(
        False,
        description="run the serving container privileged: only for TPUs on GKE before "
        "1.28; its namespace must allow the privileged Pod Security level",
    )


class PodTemplateMetadata(_Resource):
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class PodTemplateOverrides(_Resource):
    """Merged over the rendered pod: metadata maps merge, spec fields replace, containers merge by name."""

    metadata: PodTemplateMetadata = Field(default_factory=PodTemplateMetadata)
    spec: dict[str, Any] = Field(default_factory=dict)


class PickerSpec(_Resource):
    """The endpoint picker (`capstan picker`) that a Gateway consults, over Envoy's ext_proc, for every request."""

    replicas: int = Field(1, ge=1, le=16, description="picker pods")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose",
        description="when the picker cannot answer: FailOpen lets the Gateway pick a pod itself, FailClose refuses"
        " the request (the InferencePool's endpointPickerRef.failureMode)",
    )
    image: str | None = Field(None, max_length=1024, description="picker image (default: the service's image)")
    resources: dict[str, Any] | None = Field(None, description="the picker container's resources (requests, limits)")


class InferencePoolSpec(_Resource):
    """An InferencePool (Gateway API Inference Extension, inference.networking.k8s.io/v1) of the serving pods and
    its endpoint picker, so that an HTTPRoute of a GIE-capable Gateway routes to them (docs/operator.md)."""

    enabled: bool = Field(True, description="render the InferencePool and its picker; false removes them")
    picker: PickerSpec = Field(default_factory=PickerSpec)


_DIMS = "self.accelerator.topology.split('x')"
_DIM = [f"int({_DIMS}[{i}])" for i in range(3)]
_SLICE_CHIPS = f"(size({_DIMS}) == 2 ? {_DIM[0]} * {_DIM[1]} : {_DIM[0]} * {_DIM[1]} * {_DIM[2]})"  # no reduce in CEL
_HOSTS = "(has(self.parallelism) ? self.parallelism.hosts : 1)"
_REPLICA_CHIPS = f"self.accelerator.count * {_HOSTS}"


class InferenceServiceSpec(_Resource):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
                    "spec.minReplicas must be less than or equal to spec.maxReplicas",
                    ".minReplicas",
                ),
                _cel(
                    "!has(self.autoscaling) || has(self.maxReplicas)",
                    "spec.maxReplicas is required when spec.autoscaling is set",
                    ".maxReplicas",
                ),
                _cel(
                    "!has(self.runtime) || !has(self.runtime.tensorParallelSize) || !has(self.accelerator)"
                    " || self.accelerator.type == 'cpu' || self.runtime.tensorParallelSize <= " + _REPLICA_CHIPS,
                    "spec.runtime.tensorParallelSize cannot exceed spec.accelerator.count (x spec.parallelism.hosts)",
                    ".runtime.tensorParallelSize",
                ),
                _cel(
                    "!has(self.parallelism) || !has(self.parallelism.tensor) || !has(self.runtime)"
                    " || self.runtime.tensorParallelSize == 1 || self.runtime.tensorParallelSize == self.parallelism.tensor",
                    "set spec.parallelism.tensor or spec.runtime.tensorParallelSize (its older name), not both",
                    ".runtime.tensorParallelSize",
                ),
                _cel(
                    "!has(self.parallelism) || !has(self.parallelism.tensor) || !has(self.accelerator)"
                    " || self.accelerator.type == 'cpu'"
                    " || (self.accelerator.count * self.parallelism.hosts) % self.parallelism.tensor == 0",
                    "spec.parallelism.tensor must divide the replica's devices, spec.accelerator.count x"
                    " spec.parallelism.hosts",
                    ".parallelism.tensor",
                ),
                _cel(
                    "!has(self.parallelism) || self.parallelism.data == 1 || (self.parallelism.hosts == 1"
                    " && has(self.accelerator) && self.accelerator.type.startsWith('nvidia-') && self.parallelism.data"
                    " * (has(self.parallelism.tensor) ? self.parallelism.tensor : 1) <= self.accelerator.count)",
                    "spec.parallelism.data needs one host of NVIDIA GPUs, with spec.parallelism.data x"
                    " spec.parallelism.tensor at most spec.accelerator.count",
                    ".parallelism.data",
                ),
                _cel(
                    "!has(self.adapters) || !has(self.model.servedName)"
                    " || self.adapters.all(a, a.name != self.model.servedName)",
                    "spec.adapters[].name must differ from spec.model.servedName: clients pick the adapter by it",
                    ".adapters",
                ),
                _cel(
                    f"!has(self.accelerator) || !has(self.accelerator.topology) || {_SLICE_CHIPS} == {_REPLICA_CHIPS}",
                    "spec.accelerator.topology must have spec.parallelism.hosts x spec.accelerator.count chips",
                    ".accelerator.topology",
                )
                | {
                    "messageExpression": (  # string(int) would be unbounded to the cost estimate
                        "'spec.accelerator.topology ' + self.accelerator.topology + ' must have spec.parallelism.hosts x"
                        " spec.accelerator.count chips (hosts x chips per host)'"
                    )
                },
            ]
        }
    )

    model: ModelSpec
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description="LoRA adapters served beside the model, each under its own name; the running servers load"
        " added ones and unload removed ones without a restart",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    lora: LoraSpec | None = Field(None, description="LoRA settings; set (even empty) to keep LoRA on with no adapters")
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    accelerator: AcceleratorSpec = Field(default_factory=AcceleratorSpec)
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    image: str | None = Field(None, max_length=1024, description="runtime image (default: the operator's)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    resources: dict[str, Any] | None = Field(None, description="container resources (requests, limits)")
    replicas: int = Field(1, ge=0, le=1000, description="replicas when autoscaling is off")
    min_replicas: int | None = Field(None, ge=0, le=1000)
    max_replicas: int | None = Field(None, ge=1, le=1000)
    autoscaling: AutoscalingSpec | None = None
    api_key_secret: SecretKeySelector | None = Field(None, description="keys clients must send (comma-separated)")
    hf_token_secret: SecretKeySelector | None = Field(None, description="Hugging Face token for gated models")
    model_cache: ModelCacheSpec | None = None
    drain_timeout_seconds: int = Field(30, ge=0, le=3600, description="time in-flight requests get to finish")
    startup_timeout_seconds: int = Field(1800, ge=30, le=86400, description="time for download and compilation")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    security: SecuritySpec = Field(default_factory=SecuritySpec)
    pod_template: PodTemplateOverrides | None = None
    inference_pool: InferencePoolSpec | None = Field(
        None, description="route through the Gateway API Inference Extension: an InferencePool and its picker"
    )

    @model_validator(mode="after")
    def _adapters_do_not_shadow_the_model(self) -> InferenceServiceSpec:
        # The CEL rule checks an explicit servedName; this also catches the name derived from model.uri.
        served = self.model.served_name or served_model_name(self.model.uri)
        if any(adapter.name == served for adapter in self.adapters):
            raise ValueError(f"spec.adapters: an adapter is named {served!r}, the model's served name")
        return self

    def lora_enabled(self) -> bool:
        """`--enable-lora` is rendered: adapters are listed, or spec.lora keeps LoRA on without any."""
        return bool(self.adapters) or self.lora is not None

    def inference_pool_enabled(self) -> bool:
        return self.inference_pool is not None and self.inference_pool.enabled

    def bounds(self) -> tuple[int, int]:
        """The replica range the autoscaler moves within."""
        low = self.min_replicas if self.min_replicas is not None else 1
        return low, max(low, self.max_replicas if self.max_replicas is not None else max(low, self.replicas))

    def tensor_parallel_size(self) -> int:
        """`--tensor-parallel-size`: parallelism.tensor, else the older runtime field, else (several hosts)
        every device of the replica."""
        if self.parallelism.tensor is not None:
            return self.parallelism.tensor
        if self.parallelism.hosts > 1 and self.runtime.tensor_parallel_size == 1:
            return self.accelerator.count * self.parallelism.hosts
        return self.runtime.tensor_parallel_size


class Condition(_Resource):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class ScaleRecommendation(_Resource):
    time: float  # seconds since the epoch
    replicas: int


class AutoscalingStatus(_Resource):
    desired_replicas: int | None = None
    last_scale_time: str | None = None
    last_decision: str | None = None
    recommendations: list[ScaleRecommendation] = Field(default_factory=list)


class AdapterStatus(_Resource):
    name: str
    loaded_replicas: int = 0  # ready replicas whose /v1/models lists it


class ReplicaAdapters(_Resource):
    pod: str
    adapters: list[str] = Field(default_factory=list)  # what its /v1/models lists, sorted


class PickerStatus(_Resource):
    name: str
    replicas: int = 0
    ready_replicas: int = 0


class InferencePoolStatus(_Resource):
    name: str  # the InferencePool an HTTPRoute's backendRef names
    picker: PickerStatus


class InferenceServiceStatus(_Resource):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})  # kopf's bookkeeping

    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    replicas: int | None = None
    ready_replicas: int | None = None
    updated_replicas: int | None = None
    desired_replicas: int | None = None
    selector: str | None = None
    url: str | None = None
    autoscaling: AutoscalingStatus | None = None
    adapters: list[AdapterStatus] | None = None
    replica_adapters: list[ReplicaAdapters] | None = None
    inference_pool: InferencePoolStatus | None = None


class InferenceService(_Resource):
    """The custom resource as a whole; `spec` is what users write, `status` what the operator reports."""

    model_config = ConfigDict(extra="ignore")

    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None
