"""Support for the integration tests that run real `weightsync serve` subprocesses
(a pytest plugin, no tests here), loaded by tests/conftest.py's `pytest_plugins`;
and the helpers more than one of those modules calls (`make_adapter`, `halves`).

Not a conftest.py on purpose: tests/distributed pickles functions of ITS
conftest by module name ("conftest") for spawned children, which breaks when
another directory's conftest.py is imported later in the same session.

Every `launch_server` without `env` or `prefix` in the session goes through one fork
server (`weightsync.server.forkserver`): a server then starts in about 1 s instead of 5,
the imports done once (started in the background while tests/unit runs, if any test
outside tests/unit was collected).

One tiny model directory per session (weights re-drawn wider than the tiny
default so greedy decoding is not a near-tie and outputs vary with the
weights); servers are started per test module: the `server` and `client`
fixtures give a plain one, a module needing other flags overrides `server`
(with `kit.start_server`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from serve_check import checked
from torch_threads import torch_threads
from weightsync.bucketing import pack, plan_buckets
from weightsync.formats.groups import UpdateGroup, finish_hosting, host_group
from weightsync.formats.version_dir import publish, write_bucket, write_manifest
from weightsync.formats.wire import FrameHeader, encode_prefix
from weightsync.integrity import digest
from weightsync.manifest import Manifest, TensorMeta
from weightsync.server import ServerProcess, launch_server
from weightsync.server.forkserver import ForkServer
from weightsync.server.launch import use_forkserver
from widened_model import make_widened_tiny_model as make_widened_tiny_model
from widened_model import widen_weights as widen_weights

REQUEST_TIMEOUT_S = 120.0


def load_model(model_dir: Path, weights: Mapping[str, torch.Tensor] | None = None) -> Any:
    """A fresh Hugging Face model from `model_dir`, optionally with `weights` (hf_name -> tensor) copied in."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    if weights:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)
    return model


def perturbed(model_dir: Path, seed: int, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """New values for the served weights (all, or `names`): the originals plus noise."""
    from weightsync.naming import map_names

    model = load_model(model_dir)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for p in map_names(model).params:
        if names is None or p.hf_name in names:
            noise = torch.randn(p.param.shape, generator=gen, dtype=torch.float32).to(p.param.dtype)
            out[p.hf_name] = (p.param.detach() + 0.5 * noise * p.param.detach().std()).contiguous()
    return out


def reference_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF transformers' own greedy generate: tokens and their logprobs."""
    ids = torch.tensor([prompt_ids])
    # An explicit mask: generate would otherwise mask prompt tokens equal to the pad id.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=1, eos_token_id=None)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[tok]) for step, tok in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def make_update(weights: Mapping[str, torch.Tensor], *, version: int, bucket_bytes: int = 64 << 10,
                mode: str = "full", base_version: int | None = None) -> tuple[Manifest, list[torch.Tensor]]:
    """A manifest (with digests) and its packed buckets for `weights`."""
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in weights.items()], bucket_bytes)
    buffers = [pack(b, {e.hf_name: weights[e.hf_name] for e in b.entries}) for b in plan]
    manifest = Manifest(version=version, mode=mode, buckets=plan, base_version=base_version)
    return manifest.with_digests([digest(b) for b in buffers]), buffers


def frame(manifest: Manifest, index: int, buffer: torch.Tensor) -> bytes:
    """The HTTP bucket frame for bucket `index`."""
    bucket = manifest.buckets[index]
    header = FrameHeader(version=manifest.version, index=index, nbytes=bucket.nbytes, digest=digest(buffer))
    return encode_prefix(header) + buffer.numpy().tobytes()


def write_version_dir(root: Path, manifest: Manifest, buffers: list[torch.Tensor]) -> Path:
    """A disk version directory, written and published as the disk transport does."""
    tmp = root / f".tmp-v{manifest.version:08d}"
    tmp.mkdir()
    for bucket, buffer in zip(manifest.buckets, buffers, strict=True):
        write_bucket(tmp, bucket, buffer)
    write_manifest(tmp, manifest)
    final = root / f"v{manifest.version:08d}"
    publish(tmp, final)
    return final


class Client:
    """A small httpx wrapper around one server."""

    def __init__(self, url: str, *, admin_key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.url = url
        self.http = httpx.Client(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        return self.http.post(path, json=body if body is not None else {}, **kwargs)

    def ok(self, path: str, body: Any = None, **kwargs: Any) -> dict[str, Any]:
        response = self.post(path, body, **kwargs)
        assert response.status_code == 200, f"{path}: {response.status_code} {response.text}"
        return response.json()

    def generate(self, input_ids: list[int], **body: Any) -> dict[str, Any]:
        sampling = {"temperature": 0.0, "max_new_tokens": 8, **body.pop("sampling_params", {})}
        return self.ok("/generate", {"input_ids": input_ids, "sampling_params": sampling, **body})

    def digests(self) -> dict[str, str]:
        return self.ok("/weightsync/digests", {"names": None})["digests"]

    def version(self) -> int:
        return int(self.http.get("/weightsync/info").json()["weight_version"])

    def info(self) -> dict[str, Any]:
        return self.http.get("/weightsync/info").json()

    def close(self) -> None:
        self.http.close()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--exec-servers", action="store_true",
                     help="start every `weightsync serve` as a fresh interpreter, as `python -m weightsync serve` "
                          "(default: forked from the session's fork server, its imports done once)")


@pytest.fixture(scope="session", autouse=True)
def serve_forkserver(request: pytest.FixtureRequest) -> Iterator[None]:
    """The session's fork server for `weightsync serve` starts (none for a tests/unit-only run,
    or with --exec-servers)."""
    unit = Path(__file__).parent.parent / "unit"
    if request.config.getoption("--exec-servers") or all(
            item.path.is_relative_to(unit) for item in request.session.items):
        yield
        return
    with ForkServer.start() as forks:
        use_forkserver(forks)
        try:
            yield
        finally:
            use_forkserver(None)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and the server subprocess needs the other core."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The servers' --disk-root: the model lives here, update directories are written here."""
    return tmp_path_factory.mktemp("serve-root")


@pytest.fixture(scope="session")
def tiny_model(model_root: Path) -> Path:
    return make_widened_tiny_model(model_root / "tiny")


def start_server(model_dir: Path, *args: str) -> Iterator[ServerProcess]:
    """A server for a module fixture (`yield from kit.start_server(...)`): yields it, stops it,
    and fails if the server logged a traceback (an unanticipated error, a 500)."""
    yield from checked(launch_server(model_dir, args=["--num-threads", "1", *args]))


@pytest.fixture(scope="module")
def server(tiny_model: Path, one_torch_thread: None) -> Iterator[ServerProcess]:
    """A plain server for the module (a module that needs other flags overrides this)."""
    yield from start_server(tiny_model)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    """A client of the module's `server`."""
    client = Client(server.url)
    yield client
    client.close()


def joined_group(post: Callable[[dict[str, Any]], httpx.Response], group_name: str,
                 body: Callable[[int], dict[str, Any]]) -> UpdateGroup:
    """Host a 2-rank gloo weight-update group on 127.0.0.1 and have the server join it as
    rank 1 through `post(body(port))`: each peer writes its own /init_weights_update_group body."""
    holder, port = host_group(master_address="127.0.0.1", world_size=2, group_name=group_name, backend="gloo",
                              timeout_s=60)
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(post, body(port))
        group = finish_hosting(holder, timeout_s=60)
        assert joining.result().status_code == 200, joining.result().text
    return group


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The helpers above, as one fixture."""
    return SimpleNamespace(Client=Client, load_model=load_model, perturbed=perturbed,
                           reference_greedy=reference_greedy, start_server=start_server,
                           make_update=make_update, frame=frame, write_version_dir=write_version_dir,
                           joined_group=joined_group)


PROMPT = [5, 17, 42]
"""The prompt the torn-update and peer-client tests generate from."""


def halves(client: Any) -> tuple[list[str], list[str]]:
    """The served tensor names, sorted, in two halves (a push torn between them)."""
    names = sorted(client.digests())
    return names[: len(names) // 2], names[len(names) // 2 :]


def make_adapter(base_dir: Path, out_dir: Path, *, seed: int, **config: Any) -> Path:
    """A PEFT adapter directory with random, NON-ZERO lora_A and lora_B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    options = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
               "target_modules": ["q_proj", "v_proj", "down_proj"], **config}
    peft_model = get_peft_model(model, LoraConfig(**options))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(str(out_dir))
    return out_dir
