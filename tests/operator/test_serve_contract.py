"""The contract between the operator and the runtime: the command lines the operator renders are ones
that `capstan serve` and `capstan picker` accept, meaning what the spec says."""

from capstan.operator import api, render, render_pool
from capstan.runtime.cli import build_parser

OWNER = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}}


def serve_arguments(**spec):
    spec = api.InferenceServiceSpec.model_validate({"image": "capstan:test", **spec})
    container = render.render_deployment(OWNER, spec, replicas=1)["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["capstan", "serve"]
    parsed, unknown = build_parser().parse_known_args(["serve", *container["args"]])
    assert unknown == [], f"capstan serve does not know {unknown}"
    return parsed


def test_rendered_command_line_is_accepted_and_means_the_spec():
    parsed = serve_arguments(
        model={"uri": "hf://Qwen/Qwen3-0.6B@main", "servedName": "qwen"},
        runtime={
            "maxModelLen": 4096,
            "maxNumSeqs": 32,
            "pageSize": 16,
            "dtype": "bfloat16",
            "tensorParallelSize": 2,
            "extraArgs": ["--max-waiting", "64"],
        },
        accelerator={"type": "nvidia-l4", "count": 2},
        drainTimeoutSeconds=45,
    )
    assert parsed.model == "hf://Qwen/Qwen3-0.6B@main"
    assert (parsed.host, parsed.port) == ("0.0.0.0", render.SERVER_PORT)
    assert parsed.served_model_name == ["qwen"]
    assert (parsed.max_model_len, parsed.max_num_seqs, parsed.page_size) == (4096, 32, 16)
    assert (parsed.dtype, parsed.tensor_parallel_size, parsed.drain_timeout) == ("bfloat16", 2, 45)
    assert parsed.max_waiting == 64


def test_local_model_paths_are_accepted():
    assert serve_arguments(model={"uri": "pvc://weights/llama"}).model == "/mnt/models/llama"


def test_tokenizer_override_is_accepted():
    assert serve_arguments(model={"uri": "hf://org/m", "tokenizer": "hf://org/tok"}).tokenizer == "hf://org/tok"


def test_lora_flags_are_accepted_and_mean_the_spec():
    parsed = serve_arguments(
        model={"uri": "hf://Qwen/Qwen3-0.6B", "servedName": "qwen3"},
        adapters=[{"name": "sql", "source": "hf://org/sql-lora"}],
        lora={"maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 8},
    )
    assert parsed.enable_lora is True and parsed.lora_modules_file == "/etc/capstan/adapters/adapters.json"
    assert (parsed.max_loras, parsed.max_lora_rank, parsed.max_cpu_loras) == (2, 32, 8)
    assert not parsed.allow_runtime_lora_updating  # the ConfigMap is the list: no second way to change it


def test_the_rendered_picker_command_line_is_accepted_and_means_the_spec():
    spec = api.InferenceServiceSpec.model_validate(
        {
            "model": {"uri": "hf://org/m"},
            "image": "capstan:test",
            "inferencePool": {"picker": {"failureMode": "FailOpen"}},
        }
    )
    objects = render_pool.render_all(OWNER, spec, render.render_all(OWNER, spec, 1))
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["capstan", "picker"]
    parsed, unknown = build_parser().parse_known_args(["picker", *container["args"]])
    assert unknown == [], f"capstan picker does not know {unknown}"
    assert (parsed.pool_name, parsed.pool_namespace, parsed.failure_mode) == ("m", "ns", "FailOpen")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (parsed.grpc_port, parsed.grpc_health_port, parsed.metrics_port) == (
        ports["grpc"],
        ports["grpc-health"],
        ports["metrics"],
    )
