"""Weight pushes across hosts: a trainer host and two engine hosts, each a Linux
network namespace (`weightsync_tools.netns.Network`), each engine a real `weightsync serve` bound to
its host's address, the trainer a real process on its own host.

One push goes to both replicas at once over broadcast (one gloo group over three
hosts, formed with no GLOO_SOCKET_IFNAME), http and disk (a directory every host
sees); full, delta and LoRA pushes are served exactly (digests of every served
tensor equal the trainer's, greedy answers are the trainer's argmax, logprobs
agree). `shm` to an engine on another host is refused when the sync is built.

Faults across hosts, each injected just before bucket 1 goes out (a hook in the
trainer, not a timer): the link to one engine host goes down, or that host's
engine is killed. The push fails within its timeout, the other replica keeps its
last good version (every engine must answer the pause before any commits, and a
failure before the commit aborts the update on all of them), and the next push
succeeds once the link or the engine is back.

In the commit round (a hook too: the engine host dies after the other replica
committed and before its own commit goes out), the push fails and the replica that
committed is rolled back: it serves its last version again, bit for bit, under its
last version label, with no adapter of the failed push loaded.

Relayed (`fan_out="relay"`: trainer -> engine0 -> engine1, each bucket crossing the trainer's
link once), over http and over broadcast (point-to-point sends in the group): served exactly on
both hosts; the second engine host's link cut (http: or its engine killed) mid-relay: the push
fails within its bound naming the first engine's hop, both replicas keep their last version,
and the next push succeeds once the host is back; the first engine on a slow link (tc tbf):
the push completes, or (http) fails within its bound with both replicas on their last version.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from weightsync_tools.faults import error_bound_s

if TYPE_CHECKING:  # imported by pytest as a plugin, before this module's asserts are rewritten
    from multihost_fixtures import Engines, Trainer

    from weightsync_tools.netns import Network

pytest_plugins = ["multihost_fixtures"]

TRANSPORTS = ("broadcast", "http", "disk")
FAULT_TIMEOUT_S = 4.0
MAX_GAP = 1e-4
_versions = itertools.count(1)


@pytest.fixture(autouse=True, scope="module")
def _no_gloo_interface() -> Iterator[None]:
    """The groups must form without GLOO_SOCKET_IFNAME (removed for the rig's processes)."""
    saved = os.environ.pop("GLOO_SOCKET_IFNAME", None)
    yield
    if saved is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = saved


def assert_served_exactly(answer: dict, version: int, *, lora: bool = False) -> None:
    assert answer["ok"], answer.get("error")
    assert answer["verified"], answer
    assert len(answer["acks"]) == 2, answer
    for served in answer["served"]:
        assert served["token_agreement"] == 1.0, served
        assert served["max_gap"] < MAX_GAP, served
        if lora:
            assert served["gap_without_adapter"] > 1e-3, "the adapter changes the answers"
        else:
            assert served["digests_equal"], served
            assert served["serves"] == version, served
            assert served["version"] == str(version), served


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_full_delta_lora_to_two_hosts(transport: str, trainer: Trainer) -> None:
    full = next(_versions)
    assert_served_exactly(trainer.call("push", sync=f"{transport}-full", transport=transport, mode="full",
                                       version=full), full)
    trainer.call("close", sync=f"{transport}-full")

    delta = f"{transport}-delta"
    first = next(_versions)
    whole = trainer.call("push", sync=delta, transport=transport, mode="delta", version=first)
    assert_served_exactly(whole, first)
    second = next(_versions)
    changed = trainer.call("push", sync=delta, transport=transport, mode="delta", version=second,
                           only="layers.0.mlp")
    assert_served_exactly(changed, second)
    assert changed["num_tensors"] == 3 < whole["num_tensors"], "only the changed MLP tensors travel"
    trainer.call("close", sync=delta)

    adapter = next(_versions)
    assert_served_exactly(trainer.call("push", sync=f"{transport}-lora", transport=transport, mode="lora",
                                       version=adapter), adapter, lora=True)
    trainer.call("close", sync=f"{transport}-lora")


def test_shm_to_another_host_is_refused_when_built(trainer: Trainer, engines: Engines) -> None:
    answer = trainer.call("build", engine=0, transport="shm")
    assert not answer["ok"]
    message = answer["error"]
    assert engines.url(0) in message and "another host" in message, message
    for works in ("broadcast", "http", "disk"):
        assert works in message, message


def test_broadcast_hosted_on_loopback_names_the_address_to_use(trainer: Trainer, net: Network) -> None:
    """The default master_address (127.0.0.1) cannot be reached from another host: the
    error names the trainer host's address on the route to the engine."""
    answer = trainer.call("build", engine=0, transport="broadcast")
    assert not answer["ok"]
    assert f"pass master_address='{net.address('trainer')}'" in answer["error"], answer["error"]
    assert trainer.call("build", engine=0, transport="broadcast",
                        options={"master_address": net.address("trainer")})["ok"]


@pytest.mark.parametrize(("transport", "pause"), [*((t, "retract") for t in TRANSPORTS), ("disk", "none")])
def test_link_cut_mid_push(transport: str, pause: str, trainer: Trainer, net: Network) -> None:
    sync = f"{transport}-{pause}-cut"
    good = next(_versions)
    assert_served_exactly(trainer.call("push", sync=sync, transport=transport, mode="full", version=good,
                                       timeout_s=FAULT_TIMEOUT_S, pause=pause), good)
    bad = next(_versions)
    try:
        failed = trainer.call("push", sync=sync, transport=transport, mode="full", version=bad, pause=pause,
                              timeout_s=FAULT_TIMEOUT_S, fault={"at_bucket": 1, "run": net.cut_command("engine0")})
        assert not failed["ok"], "a push to an unreachable engine host fails"
        assert failed["seconds"] < error_bound_s(FAULT_TIMEOUT_S), failed
        assert trainer.call("serving", engines=[1])["serves"] == [good], "the other replica kept its last version"
    finally:
        net.restore("engine0")
    assert trainer.call("serving", engines=[0])["serves"] == [good], "the cut-off replica kept its last version"
    following = next(_versions)
    assert_served_exactly(trainer.call("push", sync=sync, transport=transport, mode="full", version=following,
                                       timeout_s=FAULT_TIMEOUT_S), following)
    trainer.call("close", sync=sync)


def test_engines_bound_to_loopback_fail_within_the_timeout(trainer: Trainer, engines: Engines) -> None:
    """Engines whose gloo device is on loopback (GLOO_SOCKET_IFNAME=lo, as a stock engine whose
    host name resolves to 127.0.1.1 would be) cannot reach each other: the push fails within
    its bound, and the next push, with the engines restarted without it, succeeds. Which
    of the group's ends reports the failure first depends on gloo's timing, so the test
    accepts each, all of them a group that did not form: the engine's join answers with
    the hint of `formats.groups._mesh_hint` when gloo gives up at once (connection refused); gloo
    may retry past the engine's group timeout, and then the trainer's wait for the join
    ends first ("joining"); or an engine that gave up (its group timeout, 1 s) closes its
    side, and the trainer's own end of the mesh fails ("did not form", with the hint)."""
    try:
        engines.restart_all(env={"GLOO_SOCKET_IFNAME": "lo"}, args=["--group-timeout", "1"])
        failed = trainer.call("push", sync="loopback", transport="broadcast", mode="full", version=next(_versions),
                              timeout_s=FAULT_TIMEOUT_S)
        assert not failed["ok"]
        assert failed["seconds"] < error_bound_s(FAULT_TIMEOUT_S), failed
        assert re.search(r"joining|did not form", failed["error"]), failed["error"]
    finally:
        engines.restart_all()
    following = next(_versions)
    assert_served_exactly(trainer.call("push", sync="loopback", transport="broadcast", mode="full",
                                       version=following, timeout_s=FAULT_TIMEOUT_S), following)
    trainer.call("close", sync="loopback")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_engine_host_killed_mid_push(transport: str, trainer: Trainer, engines: Engines) -> None:
    sync = f"{transport}-kill"
    good = next(_versions)
    assert_served_exactly(trainer.call("push", sync=sync, transport=transport, mode="full", version=good,
                                       timeout_s=FAULT_TIMEOUT_S), good)
    bad = next(_versions)
    failed = trainer.call("push", sync=sync, transport=transport, mode="full", version=bad,
                          timeout_s=FAULT_TIMEOUT_S, fault={"at_bucket": 1, "kill": engines.pid(0)})
    assert not failed["ok"], "a push to a killed engine fails"
    assert failed["seconds"] < error_bound_s(FAULT_TIMEOUT_S), failed
    assert trainer.call("serving", engines=[1])["serves"] == [good], "the other replica kept its last version"
    engines.restart(0)
    following = next(_versions)
    assert_served_exactly(trainer.call("push", sync=sync, transport=transport, mode="full", version=following,
                                       timeout_s=FAULT_TIMEOUT_S), following)
    trainer.call("close", sync=sync)


@pytest.mark.parametrize(("transport", "mode"), [("broadcast", "full"), ("http", "delta"), ("disk", "lora")])
def test_engine_host_lost_in_the_commit_round(transport: str, mode: str, trainer: Trainer, engines: Engines) -> None:
    sync = f"{transport}-{mode}-commit"
    good = next(_versions)
    assert_served_exactly(trainer.call("push", sync=sync, transport=transport, mode=mode, version=good,
                                       timeout_s=FAULT_TIMEOUT_S), good, lora=mode == "lora")
    before = trainer.call("serving", engines=[1])
    bad = next(_versions)
    failed = trainer.call("push", sync=sync, transport=transport, mode=mode, version=bad,
                          timeout_s=FAULT_TIMEOUT_S, fault={"in_commit": 0, "kill": engines.pid(0)})
    assert not failed["ok"], "a push whose replica is lost in the commit round fails"
    assert failed["seconds"] < error_bound_s(FAULT_TIMEOUT_S), failed
    after = trainer.call("serving", engines=[1])
    assert after == before, "the replica that committed was rolled back to its last version"
    assert after["versions"] == [str(good)], after
    engines.restart(0)
    following = next(_versions)
    assert_served_exactly(trainer.call("push", sync=sync, transport=transport, mode=mode, version=following,
                                       timeout_s=FAULT_TIMEOUT_S), following, lora=mode == "lora")
    trainer.call("close", sync=sync)


def test_lora_after_an_engine_restart_syncs_the_base_again(trainer: Trainer, engines: Engines) -> None:
    """An engine restarted between two lora pushes that both succeed serves its checkpoint's
    base again: the next lora push sees its new process id and pushes the trainer's base
    first (the trainer's base differs from the checkpoint: a full push moved it)."""
    moved = next(_versions)
    assert_served_exactly(trainer.call("push", sync="restart-full", transport="http", mode="full", version=moved,
                                       timeout_s=FAULT_TIMEOUT_S), moved)
    first = next(_versions)
    assert_served_exactly(trainer.call("push", sync="restart-lora", transport="http", mode="lora", version=first,
                                       timeout_s=FAULT_TIMEOUT_S), first, lora=True)
    engines.restart(0)
    assert trainer.call("serving", engines=[0])["serves"] == [0], "the restarted engine serves its checkpoint"
    following = next(_versions)
    assert_served_exactly(trainer.call("push", sync="restart-lora", transport="http", mode="lora",
                                       version=following, timeout_s=FAULT_TIMEOUT_S), following, lora=True)
    for sync in ("restart-full", "restart-lora"):
        trainer.call("close", sync=sync)


@pytest.mark.parametrize(("transport", "fault"), [("http", "kill"), ("broadcast", "cut")])
def test_relay_across_hosts_and_the_next_host_lost_mid_relay(transport: str, fault: str, trainer: Trainer,
                                                            engines: Engines, net: Network) -> None:
    """Over broadcast the relay's hops are point-to-point sends in the group: the cut leaves
    the first engine's send to the second unanswered, which it reports after half timeout_s."""
    sync = f"relay-{transport}-{fault}"
    good = next(_versions)
    assert_served_exactly(trainer.call("push", sync=sync, transport=transport, mode="full", version=good,
                                       timeout_s=FAULT_TIMEOUT_S, fan_out="relay"), good)
    bad = next(_versions)
    injected = {"kill": engines.pid(1)} if fault == "kill" else {"run": net.cut_command("engine1")}
    try:
        failed = trainer.call("push", sync=sync, transport=transport, mode="full", version=bad, fan_out="relay",
                              timeout_s=FAULT_TIMEOUT_S, fault={"at_bucket": 1, **injected})
        assert not failed["ok"], "a relay whose next host is lost fails"
        assert failed["seconds"] < error_bound_s(FAULT_TIMEOUT_S), failed
        assert engines.url(0) in failed["error"] and engines.url(1) in failed["error"], failed["error"]
        assert trainer.call("serving", engines=[0])["serves"] == [good], "the first replica kept its last version"
    finally:
        if fault == "kill":
            engines.restart(1)
        else:
            net.restore("engine1")
    if fault == "cut":
        assert trainer.call("serving", engines=[1])["serves"] == [good], "the cut-off replica kept its version"
    following = next(_versions)
    assert_served_exactly(trainer.call("push", sync=sync, transport=transport, mode="full", version=following,
                                       timeout_s=FAULT_TIMEOUT_S, fan_out="relay"), following)
    trainer.call("close", sync=sync)


@pytest.mark.parametrize(("transport", "rate_bits", "completes"),
                         [("http", 40e6, True), ("http", 0.25e6, False), ("broadcast", 40e6, True)])
def test_a_slow_engine_in_the_middle_of_the_relay(transport: str, rate_bits: float, completes: bool,
                                                  trainer: Trainer, net: Network) -> None:
    """The first engine of trainer -> engine0 -> engine1 on a slow link: at 40 Mbit/s the push
    completes (about 1.7 MB each way); at 0.25 Mbit/s one 256 KiB bucket takes about 8 s, twice
    timeout_s, so the push fails within its bound (http; over broadcast that case is the
    trainer's own send timing out, which the faults suite covers). Either way both replicas end
    on one version, and the next push, at full speed, succeeds."""
    sync = f"relay-slow-{transport}-{int(rate_bits)}"
    good = next(_versions)
    assert_served_exactly(trainer.call("push", sync=sync, transport=transport, mode="full", version=good,
                                       timeout_s=FAULT_TIMEOUT_S, fan_out="relay"), good)
    pushed = next(_versions)
    net.shape("engine0", rate_bits=rate_bits, burst_bytes=16 << 10)
    try:
        answer = trainer.call("push", sync=sync, transport=transport, mode="full", version=pushed, fan_out="relay",
                              timeout_s=FAULT_TIMEOUT_S)
    finally:
        net.unshape("engine0")
    if completes:
        assert_served_exactly(answer, pushed)
    else:
        assert not answer["ok"], "a relay through an engine slower than timeout_s allows fails"
        assert "no answer within" in answer["error"], answer["error"]
        assert answer["seconds"] < error_bound_s(FAULT_TIMEOUT_S), answer
        assert trainer.call("serving", engines=[0, 1])["serves"] == [good, good], "no mix of versions"
    following = next(_versions)
    assert_served_exactly(trainer.call("push", sync=sync, transport=transport, mode="full", version=following,
                                       timeout_s=FAULT_TIMEOUT_S, fan_out="relay"), following)
    trainer.call("close", sync=sync)
