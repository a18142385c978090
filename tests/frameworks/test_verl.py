"""The verl checkpoint-engine backend `"weightsync"`, driven by verl 0.9.1's own code on CPU.

One Ray session for the module (`ray.init(num_cpus=2)`): two actor ranks (`FsdpActorWorker`:
an FSDP2 float32 model over a gloo group, verl's checkpoint engine built as verl's actor
worker builds it) and two rollout workers, each verl's own `CheckpointEngineWorker` with a
server adapter that loads what `receive_weights` yields into its own `weightsync serve`
(bfloat16, SGLang's API). Every update goes through verl's `CheckpointEngineManager.
update_weights` (prepare on every worker, `build_topology`, `init_process_group`,
`send_weights` on the actor ranks beside `update_weights` on the rollout workers,
`finalize`), selected as a user selects it: `backend="weightsync"`,
`custom_backend_module="weightsync.integrations.verl"`.

What is checked: both engines serve the trainer's weights cast to bfloat16 bit for bit
(xxh3 of every tensor); a corrupted bucket, a truncated one and a rollout worker killed
mid-update each make every actor rank's `send_weights` raise and leave both engines on
their last weights and version. The plan of verl's weight generator is checked against
weightsync's own planner and packer without processes.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from weightsync.bucketing import pack, plan_buckets
from weightsync.integrations.verl_plan import StreamPlan
from weightsync.manifest import TensorMeta
from weightsync.push.pipeline import stream_buckets
from weightsync.reports import Stages
from weightsync.server import ServerProcess, launch_server
from weightsync.tiny import TinyModelConfig, make_tiny_model
from weightsync.transports import make_receiver

HERE = Path(__file__).resolve().parent
BUCKET_MB = 1
"""verl's update_weights_bucket_megabytes: the tiny model (3.6 MB in bfloat16) goes in 5 buckets."""
MODEL = TinyModelConfig(intermediate_size=2048)
ENGINE_KWARGS: dict[str, Any] = {"timeout_s": 60.0}
"""checkpoint_engine.engine_kwargs.weightsync: the defaults (broadcast, bfloat16, hold_update)."""


RAY_OBJECT_STORE_BYTES = 128 << 20
"""Ray's shared-memory object store, in bytes (its default is 30% of the machine's memory, capped
by /dev/shm): verl's workers pass handles and small dicts through it, never tensors here."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, Any]:
    """A Ray runtime_env: this checkout's weightsync and the fixtures module, plus `extra`."""
    path = os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE), str(HERE.parent / "support")])
    return {"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}}


class Client:
    """What the tests ask a `weightsync serve`: its version, label and every tensor's digest."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=120)

    def info(self) -> dict[str, Any]:
        answer: dict[str, Any] = self.http.get("/weightsync/info").json()
        return answer

    def version(self) -> int:
        return int(self.info()["weight_version"])

    def digests(self) -> dict[str, str]:
        answer = self.http.post("/weightsync/digests", json={"names": None})
        assert answer.status_code == 200, answer.text
        digests: dict[str, str] = answer.json()["digests"]
        return digests

    def close(self) -> None:
        self.http.close()


def bf16_metas(weights: dict[str, torch.Tensor]) -> list[TensorMeta]:
    """What the backend plans the trainer's weights as: each tensor in bfloat16, in order."""
    return [TensorMeta(hf_name=n, dtype=torch.bfloat16, shape=tuple(t.shape)) for n, t in weights.items()]


@dataclass
class Fleet:
    """verl's manager, its actor and rollout workers, and the engines they load into."""

    manager: Any
    actor_wg: Any
    actors: list[Any]
    replicas: list[Any]
    servers: list[ServerProcess]
    trainer_dir: Path
    rollout_config: Any
    model_config: Any
    step: int = 0
    clients: list[Client] = field(default_factory=list)

    def next_step(self) -> int:
        self.step += 1
        self.actor_wg.train_to(self.step)
        return self.step

    def served(self) -> list[tuple[int, dict[str, str]]]:
        """(version, digests) each engine serves."""
        return [(c.version(), c.digests()) for c in self.clients]

    def rollout(self, index: int) -> Any:
        return self.replicas[index].workers[0]

    def set_receiver(self, index: int, receiver: Any) -> None:
        """Put `receiver` in rollout worker `index`'s checkpoint engine, through verl's own
        `execute_checkpoint_engine` (failure injection and its removal)."""
        import ray

        ray.get(self.rollout(index).execute_checkpoint_engine.remote("__setattr__", "receiver", receiver))

    def rebuild_engines(self, **engine_kwargs: Any) -> None:
        """Build every worker's checkpoint engine again with `engine_kwargs`: the constructor
        verl calls with the arguments verl passes, run through verl's own
        `execute_checkpoint_engine` (as a new `engine_kwargs.weightsync` config would build them)."""
        import ray

        bucket_size = BUCKET_MB << 20
        ray.get(self.actor_wg.execute_checkpoint_engine(
            ["__init__"] * 2, [bucket_size] * 2, is_master=[True, False],
            **{key: [value] * 2 for key, value in engine_kwargs.items()}))
        ray.get([self.rollout(i).execute_checkpoint_engine.remote("__init__", bucket_size, **engine_kwargs)
                 for i in range(2)])

    def start_rollout(self, index: int) -> Any:
        """A new CheckpointEngineWorker for replica `index` (its engine stays)."""
        import ray
        from verl.checkpoint_engine import CheckpointEngineWorker
        from verl_fixtures import ServeAdapter

        worker = ray.remote(CheckpointEngineWorker).options(runtime_env=_env(
            RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))).remote(
            self.rollout_config, self.model_config,
            server_adapter=ServeAdapter(self.servers[index].url, bucket_bytes=BUCKET_MB << 20))
        self.replicas[index].workers = [worker]
        return worker


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

    sys.path.insert(0, str(HERE))  # verl_fixtures, as the Ray workers import it
    from verl_fixtures import FakeReplica, FsdpActorWorker

    root = tmp_path_factory.mktemp("verl")
    trainer_dir = make_tiny_model(root / "trainer", MODEL)
    engine_dir = make_tiny_model(root / "engine", TinyModelConfig(intermediate_size=2048, dtype="bfloat16"))
    config = CheckpointEngineConfig(
        backend="weightsync", update_weights_bucket_megabytes=BUCKET_MB,
        custom_backend_module="weightsync.integrations.verl", engine_kwargs={"weightsync": ENGINE_KWARGS})
    servers: list[ServerProcess] = []
    pool = ThreadPoolExecutor(2)
    starting = [pool.submit(launch_server, engine_dir, args=["--num-threads", "1"]) for _ in range(2)]
    try:
        ray.init(num_cpus=2, include_dashboard=False, runtime_env=_env(), logging_level="WARNING",
                 log_to_driver=False, object_store_memory=RAY_OBJECT_STORE_BYTES)
        # the actor ranks start (import verl, build the FSDP2 model) while the engines start
        actor_cls = ray.remote(FsdpActorWorker)
        port = str(_free_port())
        actors = [actor_cls.options(runtime_env=_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                     MASTER_PORT=port)).remote(config, str(trainer_dir))
                  for rank in range(2)]
        actor_wg = RayWorkerGroup(worker_handles=actors, ray_cls_with_init=RayClassWithInitArgs(cls=actor_cls))
        servers = [s.result() for s in starting]
        fleet = Fleet(manager=None, actor_wg=actor_wg, actors=actors, replicas=[FakeReplica([]), FakeReplica([])],
                      servers=servers, trainer_dir=trainer_dir,
                      rollout_config=RolloutConfig(name="sglang", checkpoint_engine=config),
                      model_config=HFModelConfig(path=str(engine_dir)), clients=[Client(s.url) for s in servers])
        for index in range(2):
            fleet.start_rollout(index)
        fleet.manager = CheckpointEngineManager(config=config, actor_wg=actor_wg, replicas=fleet.replicas)
        yield fleet
        for client in fleet.clients:
            client.close()
    finally:
        ray.shutdown()
        pool.shutdown()
        for server in servers or [s.result() for s in starting if s.exception() is None]:
            server.close()


def test_update_through_verls_manager_serves_the_trainers_weights(fleet: Fleet) -> None:
    from verl_fixtures import bf16_digests, trainer_weights

    for _ in range(2):  # the second update re-forms the group as verl's manager does every step
        step = fleet.next_step()
        metrics = fleet.manager.update_weights(global_steps=step)
        want = bf16_digests(trainer_weights(str(fleet.trainer_dir), step))
        for _, served in fleet.served():
            assert served == want
        for client in fleet.clients:
            assert client.info()["label"] == str(step)  # the adapter's weight_version: verl's global_steps
        assert metrics["weightsync/verified"] == 1 and metrics["weightsync/version"] == step
        metas = bf16_metas(trainer_weights(str(fleet.trainer_dir), step))
        assert metrics["weightsync/buckets"] == len(plan_buckets(metas, BUCKET_MB << 20)) > 1
        assert metrics["weightsync/bytes"] == sum(m.nbytes for m in metas)


@pytest.mark.parametrize("transport", ["shm", "disk"])
def test_shm_and_disk_transports(fleet: Fleet, transport: str, tmp_path: Path) -> None:
    from verl_fixtures import bf16_digests, trainer_weights

    fleet.rebuild_engines(transport=transport, disk_root=str(tmp_path), timeout_s=ENGINE_KWARGS["timeout_s"])
    try:
        step = fleet.next_step()
        metrics = fleet.manager.update_weights(global_steps=step)
        assert metrics["weightsync/verified"] == 1
        want = bf16_digests(trainer_weights(str(fleet.trainer_dir), step))
        assert [served for _, served in fleet.served()] == [want, want]
    finally:
        fleet.rebuild_engines(**ENGINE_KWARGS)


@pytest.mark.parametrize(("fault", "reason"), [
    ("corrupt", "corrupted in transit"),
    ("truncate", "truncated or padded"),
    ("kill", "the weightsync group broke"),
])
def test_a_bad_bucket_or_a_lost_rollout_worker_fails_every_sender(fleet: Fleet, fault: str, reason: str) -> None:
    import ray
    from verl_fixtures import FaultyReceiver, trainer_weights

    if not fleet.served()[0][0]:  # this test alone: give the engines a first verified update
        fleet.manager.update_weights(global_steps=fleet.next_step())
    before = fleet.served()
    step = fleet.next_step()
    # the last bucket: verl's adapter has loaded the ones before it by then, unless they are held
    last = len(plan_buckets(bf16_metas(trainer_weights(str(fleet.trainer_dir), step)), BUCKET_MB << 20)) - 1
    fleet.set_receiver(1, FaultyReceiver("broadcast", fault, last))
    try:
        with pytest.raises((ray.exceptions.RayTaskError, ray.exceptions.RayActorError)):
            fleet.manager.update_weights(global_steps=step)
        outcomes = ray.get([actor.last_outcome.remote() for actor in fleet.actors])
        for outcome in outcomes:  # the sending rank's own error, and the other rank's from its verdict
            assert not outcome["ok"] and outcome["error"] == "UpdateRefusedError", outcome
            assert f"weight update v{step} refused" in outcome["message"] and reason in outcome["message"], outcome
        if fault != "kill":
            assert f"rollout rank 2 refused: bucket {last}" in outcomes[0]["message"], outcomes[0]
        assert fleet.served() == before  # neither engine loaded a tensor of the refused update
    finally:
        if fault == "kill":
            fleet.start_rollout(1)
        else:
            fleet.set_receiver(1, make_receiver("broadcast"))
    step = fleet.next_step()  # and the next update goes through
    fleet.manager.update_weights(global_steps=step)
    assert all(version > before[0][0] for version, _ in fleet.served())


def test_streaming_option_yields_checked_buckets_but_is_not_all_or_nothing(fleet: Fleet) -> None:
    """hold_update=False: the update arrives whole when nothing fails; a bad last bucket
    still makes every actor rank raise, but the batches verl's adapter loaded before it stay
    loaded (what docs/INTEGRATIONS.md says the option costs)."""
    import ray
    from verl_fixtures import FaultyReceiver, bf16_digests, trainer_weights

    fleet.rebuild_engines(**ENGINE_KWARGS, hold_update=False)
    try:
        step = fleet.next_step()
        fleet.manager.update_weights(global_steps=step)
        good = bf16_digests(trainer_weights(str(fleet.trainer_dir), step))
        assert [served for _, served in fleet.served()] == [good, good]

        step = fleet.next_step()
        last = len(plan_buckets(bf16_metas(trainer_weights(str(fleet.trainer_dir), step)), BUCKET_MB << 20)) - 1
        fleet.set_receiver(1, FaultyReceiver("broadcast", "corrupt", last))
        with pytest.raises(ray.exceptions.RayTaskError):
            fleet.manager.update_weights(global_steps=step)
        outcomes = ray.get([actor.last_outcome.remote() for actor in fleet.actors])
        assert all(o["error"] == "UpdateRefusedError" and "corrupted in transit" in o["message"] for o in outcomes)
        new = bf16_digests(trainer_weights(str(fleet.trainer_dir), step))
        for _, served in fleet.served():  # part of the refused update is served: earlier batches, not the last
            changed = {name for name in served if served[name] != good[name]}
            assert changed and changed < set(served) and all(served[name] == new[name] for name in changed)
    finally:
        fleet.set_receiver(1, make_receiver("broadcast"))
        fleet.rebuild_engines(**ENGINE_KWARGS)


def test_stream_plan_is_weightsyncs_plan_and_bytes() -> None:
    """verl's generator planned as it is read gives the buckets `plan_buckets` gives for
    the same metas, and the pipeline packs the bytes `pack` packs (cast to bfloat16)."""
    gen = torch.Generator().manual_seed(0)
    weights = [(f"w{i}", torch.randn(37 * (i % 5 + 1), 8, generator=gen)) for i in range(23)]
    weights += [("ids", torch.arange(5)), ("big", torch.randn(3000, generator=gen)), ("scalar", torch.tensor(2.5))]
    plan = StreamPlan(iter(weights), bucket_bytes=4096, dtype=torch.bfloat16)
    packed: list[torch.Tensor] = []
    digests = stream_buckets(plan, plan.buckets(), (), None, slot=lambda i, n: torch.empty(n, dtype=torch.uint8),
                             deliver=lambda b, buf: packed.append(buf.clone()), stages=Stages())
    metas = [TensorMeta(hf_name=n, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype, shape=tuple(t.shape))
             for n, t in weights]
    assert tuple(plan.planned) == plan_buckets(metas, 4096)
    by_name = dict(weights)
    want = [pack(b, {e.hf_name: by_name[e.hf_name] for e in b.entries}) for b in plan.planned]
    assert len(digests) == len(want) > 3 and all(torch.equal(a, b) for a, b in zip(packed, want, strict=True))
    with pytest.raises(ValueError, match="'w1' is yielded twice"):
        list(StreamPlan(iter([weights[1], weights[1]]), bucket_bytes=4096, dtype=None).buckets())
    with pytest.raises(ValueError, match="update_weights_bucket_megabytes to at least 1"):
        list(StreamPlan(iter(weights), bucket_bytes=4096, dtype=None, max_tensor_bytes=4096).buckets())


def test_routers_travel_in_the_actors_dtype() -> None:
    """A float32 actor's MoE routers (GLM-4.5 / DeepSeek-V3: vLLM holds `mlp.gate.weight` and
    `e_score_correction_bias` in float32 under a bfloat16 model) go as float32, every other
    floating tensor as bfloat16: the packed bytes are the router's own float32 bytes."""
    from weightsync.integrations.verl import KEEP_DTYPE, VerlBackendConfig

    gen = torch.Generator().manual_seed(1)
    weights = [("model.layers.1.self_attn.q_proj.weight", torch.randn(16, 8, generator=gen)),
               ("model.layers.1.mlp.gate.weight", torch.randn(4, 8, generator=gen)),
               ("model.layers.1.mlp.gate.e_score_correction_bias", torch.randn(4, generator=gen))]
    assert VerlBackendConfig().keep_dtype == KEEP_DTYPE
    plan = StreamPlan(iter(weights), bucket_bytes=4096, dtype=torch.bfloat16,
                      keep_dtype=VerlBackendConfig.from_kwargs({"keep_dtype": list(KEEP_DTYPE)}).keep_dtype)
    packed: list[torch.Tensor] = []
    stream_buckets(plan, plan.buckets(), (), None, slot=lambda i, n: torch.empty(n, dtype=torch.uint8),
                   deliver=lambda b, buf: packed.append(buf.clone()), stages=Stages())
    [bucket] = plan.planned
    assert {e.hf_name: e.dtype for e in bucket.entries} == {
        "model.layers.1.self_attn.q_proj.weight": torch.bfloat16,
        "model.layers.1.mlp.gate.weight": torch.float32,
        "model.layers.1.mlp.gate.e_score_correction_bias": torch.float32}
    by_name = dict(weights)
    assert torch.equal(packed[0], pack(bucket, {e.hf_name: by_name[e.hf_name] for e in bucket.entries}))
    router = next(e for e in bucket.entries if e.hf_name.endswith("mlp.gate.weight"))
    raw = packed[0][router.offset:router.offset + router.nbytes]
    assert torch.equal(raw.view(torch.float32).view(4, 8), by_name["model.layers.1.mlp.gate.weight"])
    with pytest.raises(ValueError, match="keep_dtype must be a list of name endings"):
        VerlBackendConfig.from_kwargs({"keep_dtype": "mlp.gate.weight"})
