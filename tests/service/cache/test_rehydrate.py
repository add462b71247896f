"""Rehydration: frames opened once and dequantized a few layers at a time, a gate the forward step waits on."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cachestore.codec import Codec, kernels
from cachestore.codec import attend as in_codes
from cachestore.errors import CodecError
from service.cache.lookup import chunk_plan
from service.cache.rehydrate import Rehydration
from service.engines import GenParams
from service.engines.gate import LayerGate, LayerSource
from service.engines.generation import Generation, GenRequest
from service.engines.hf.engine import HfEngine
from service.engines.hf.hfcache import ATTEND_MAX_NEW

MODES = ["exact", "fp16", "int8", "int4", "int2", "int4/rotv", "int2+zstd", "int4/g32/clip", "fp16+zstd",
         "q8", "int2+zstd/rotv/clip/outk/symv/s8", "int4/outk/s8"]


@pytest.mark.parametrize("mode", MODES)
def test_layers_decoded_apart_equal_the_whole_frame(mode: str) -> None:
    kv = torch.randn(5, 2, 3, 16, 64, generator=torch.Generator().manual_seed(1))  # [L, 2, H, T, D]
    codec = Codec(mode)
    frame = codec.encode(kv)
    whole = codec.decode(frame, device="cpu").float()
    opened = codec.open(frame)
    assert opened.splits_by_layer
    out = torch.full_like(kv, float("nan"))
    for first, stop in ((3, 5), (0, 1), (1, 3)):  # any order, any grouping
        opened.decode_into(out[first:stop], slice(first, stop))
    assert torch.equal(out, whole)


def test_packed_codes_that_end_mid_byte_decode_whole_only() -> None:
    kv = torch.randn(2, 2, 1, 3, 3, generator=torch.Generator().manual_seed(2))  # 9 two-bit codes per layer
    codec = Codec("int2/plain")
    opened = codec.open(codec.encode(kv))
    assert not opened.splits_by_layer
    with pytest.raises(CodecError, match="split by layer"):
        opened.decode_into(torch.empty(1, 2, 1, 3, 3), slice(0, 1))
    # the rehydration decodes such a frame whole, before the layer groups
    out = torch.full((2, 2, 1, 3, 3), float("nan"))
    rehydration = Rehydration(out, 3, lambda frame, i: codec.open(frame), layerwise=True)
    rehydration.feed([codec.encode(kv)])
    rehydration.end()
    rehydration.run(lambda n, nbytes: None)
    rehydration.gate.wait_all()  # the layer groups are handed over: the waiter runs them
    assert torch.equal(out, codec.decode(codec.encode(kv), device="cpu").float())


@pytest.mark.parametrize("spec", ["q8", "fp16/rows"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_token_row_frames_rehydrate_into_a_context_like_any_other(spec: str, layerwise: bool) -> None:
    """Token-rows frames (an hf pod reading q8, or rows a llama.cpp pod wrote) are no landed run: each is decoded
    whole, or by layer groups handed over to the forward step, into a head-major context."""
    codec = Codec(spec)
    kvs = [torch.randn(3, 2, 2, 8, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    out = torch.full((3, 2, 2, 40, 64), float("nan"))
    rehydration = Rehydration(out, 8, lambda frame, i: codec.open(frame), layerwise=layerwise)
    frames = [codec.encode(kv) for kv in kvs]
    rehydration.feed(frames[:2])
    rehydration.feed(frames[2:])
    rehydration.end()
    rehydration.run(lambda n, nbytes: None)
    rehydration.gate.wait_all()
    want = torch.cat([codec.decode(f, device="cpu").float() for f in frames], dim=3)
    assert torch.equal(out[:, :, :, :32], want) and out[:, :, :, 32:].isnan().all()


def test_chunk_plan_ends_with_a_short_chunk_and_covers_every_block_once() -> None:
    assert chunk_plan(0) == []
    assert chunk_plan(5, size=8, last=2) == [range(0, 5)]
    assert chunk_plan(32, size=8, last=2) == [range(0, 8), range(8, 16), range(16, 24), range(24, 30), range(30, 32)]
    for blocks in range(1, 70):
        plan = chunk_plan(blocks, size=8, last=2)
        assert [i for r in plan for i in r] == list(range(blocks))
        assert all(0 < len(r) <= 8 for r in plan)


def test_gate_releases_waiters_in_layer_order_and_reports_failure() -> None:
    gate = LayerGate(4)
    events: list[object] = []  # what happened, in order: a release, or the layer a waiter passed
    at_gate = {layer: threading.Event() for layer in (3, 1)}

    def waiter(layer: int) -> None:
        at_gate[layer].set()
        gate.wait(layer)
        events.append(layer)

    threads = [threading.Thread(target=waiter, args=(layer,)) for layer in (3, 1)]
    for t in threads:
        t.start()
    assert all(e.wait(5) for e in at_gate.values())  # both waiters at the gate before anything is released
    events.append("release 2")
    gate.release(2)  # layers 0 and 1 in place
    threads[1].join(5)
    assert events == ["release 2", 1] and threads[0].is_alive()
    events.append("release 4")
    gate.release(4)
    threads[0].join(5)
    assert events == ["release 2", 1, "release 4", 3]

    failing = LayerGate(2)
    failing.release(1)
    failing.wait(0)  # in place already: no wait
    failing.fail(CodecError("boom"))
    with pytest.raises(RuntimeError, match="could not be rehydrated"):
        failing.wait(1)


def test_handed_over_work_that_fails_fails_every_later_waiter_without_running_again() -> None:
    """A bug in the handed-over work (the forward step's thread runs it) fails that layer's wait and every wait
    or fill after it, with the same cause: the work is not retried over a half-written context."""
    gate = LayerGate(3)
    calls: list[int] = []

    class Buggy(LayerSource):
        def work(self, first: int) -> int:
            calls.append(first)
            raise ValueError("a bug")

        def fill(self, layer: int, dest: object) -> bool:
            return True

    gate.hand_over(Buggy())
    for attempt in (lambda: gate.wait(0), lambda: gate.wait(2), lambda: gate.fill(1, torch.empty(0))):
        with pytest.raises(RuntimeError, match="could not be rehydrated") as caught:
            attempt()
        assert isinstance(caught.value.__cause__, ValueError)
    assert calls == [0]


def test_rehydration_truncates_at_a_bad_frame_and_hands_layers_over_in_order() -> None:
    layers, b = 6, 4
    kv = torch.randn(layers, 2, 2, 6 * b, 8, generator=torch.Generator().manual_seed(3))
    codec = Codec("int8")
    frames = [codec.encode(kv[:, :, :, i * b:(i + 1) * b]) for i in range(6)]
    frames[4] = frames[4][:-1] + bytes([frames[4][-1] ^ 1])  # corrupt: the hit stops at block 4

    def open_block(frame: bytes, index: int) -> object:
        try:
            return codec.open(frame)
        except CodecError:
            return None

    out = torch.full((layers, 2, 2, 8 * b, 8), float("nan"))
    decoded: list[float] = []
    rehydration = Rehydration(out, b, open_block, layerwise=True, on_decoded=decoded.append)  # type: ignore[arg-type]
    verified: list[tuple[int, int]] = []
    seen: dict[int, bool] = {}
    expected = torch.cat([codec.decode(f, device="cpu").float() for f in frames[:4]], dim=3)  # [L, 2, H, 16, D]

    def forward_step() -> None:  # what the model does: each layer once it is in place
        for layer in range(layers):
            rehydration.gate.wait(layer)
            seen[layer] = torch.equal(out[layer, :, :, :4 * b], expected[layer])

    consumer = threading.Thread(target=forward_step)
    consumer.start()
    # every frame arrives before the thread runs: nothing is dequantized whole; the layer groups are handed
    # over to the consumer, which dequantizes each group when it reaches it
    rehydration.feed(frames[:3])
    rehydration.feed(frames[3:])
    rehydration.end()
    rehydration.run(lambda n, nbytes: verified.append((n, nbytes)))
    consumer.join(10)
    assert verified == [(4, sum(len(f) for f in frames[:4]))]
    assert rehydration.stopped.is_set()
    assert seen == {layer: True for layer in range(layers)}
    assert torch.isnan(out[:, :, :, 4 * b:]).all()  # nothing past the bad frame was written
    assert len(decoded) == 1 and decoded[0] > 0  # the time, reported once the consumer ran the last group


def test_the_forward_step_waits_for_cached_layers(tiny_model: object) -> None:
    """An hf generation over a context still being rehydrated waits on the gate before it reads the context,
    then answers as if the context had been there all along."""
    engine = HfEngine(tiny_model)  # type: ignore[arg-type]
    prompt = list(range(50, 90))
    full = engine.generate(GenRequest(prompt, None, GenParams(max_tokens=4)))
    assert full.kv is not None
    geo = engine.geometry
    buffer = torch.zeros((geo.num_layers, 2, geo.kv_heads, 64, geo.head_dim), dtype=geo.dtype)
    gate = LayerGate(geo.num_layers)
    waiting, go = threading.Event(), threading.Event()

    class PutInPlace(LayerSource):  # the handed-over source: pulled by the forward step when it needs layer 0
        def work(self, first: int) -> int:
            waiting.set()
            assert go.wait(30)
            return geo.num_layers

    gate.hand_over(PutInPlace())
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(
        engine.generate(GenRequest(prompt, buffer[:, :, :, :39], GenParams(max_tokens=4), kv_ready=gate))))
    worker.start()
    assert waiting.wait(30) and not result  # the forward step waits on layer 0, before reading the context
    buffer[:, :, :, :39] = full.kv[:, :, :, :39]
    go.set()
    worker.join(30)
    gen = result[0]
    assert gen.cached_tokens == 39 and gen.token_ids == full.token_ids  # type: ignore[attr-defined]


def test_an_unexpected_failure_reaches_the_waiter_at_once() -> None:
    """A bug while dequantizing (here a whole frame, while the next chunk would be on the wire) must fail the
    generation waiting on the gate, not leave it waiting a minute."""

    class Broken:
        splits_by_layer = True

        def decode_into(self, out: object, layers: object = None) -> None:
            raise ValueError("a bug")

    out = torch.zeros(2, 2, 1, 8, 4)
    rehydration = Rehydration(out, 4, lambda frame, i: Broken(), layerwise=True)  # type: ignore[arg-type,return-value]
    verified: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            rehydration.run(lambda n, nbytes: verified.append((n, nbytes)))
        except ValueError as exc:
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    rehydration.feed([b"x", b"y"])  # nothing else queued: the thread dequantizes the first frame whole
    thread.join(5)
    assert not thread.is_alive() and len(errors) == 1 and verified == [(2, 2)]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="could not be rehydrated"):
        rehydration.gate.wait_all()
    assert time.monotonic() - start < 1.0


def _landed_hit(engine: HfEngine, spec: str, new: int, max_tokens: int) -> tuple[list[int], Generation, torch.Tensor,
                                                                            Rehydration, int]:
    """A hit of three blocks of 16 tokens whose frames (codec `spec`) landed, and a prompt tail of 5 decoded into the
    context (a session's partial block), before `new` new tokens: (prompt, the full prefill's generation, the context
    with NaN where the frames go, the rehydration handed over to the forward step, the cached tokens)."""
    from cachestore.codec import FrameRun  # noqa: PLC0415

    geo, b, tail = engine.geometry, 16, 5
    cached = 3 * b + tail
    prompt = list(range(60, 60 + cached + new))
    full = engine.generate(GenRequest(prompt, None, GenParams(max_tokens=max_tokens)))
    assert full.kv is not None
    codec = Codec(spec)
    frames = [codec.encode(full.kv[:, :, :, i * b:(i + 1) * b]) for i in range(3)]
    stride = -(-len(frames[0]) // 64) * 64
    landing = torch.zeros(3 * stride, dtype=torch.uint8)
    view = memoryview(landing.numpy())
    slots = [view[i * stride:i * stride + len(f)] for i, f in enumerate(frames)]
    for slot, frame in zip(slots, frames, strict=True):
        slot[:] = frame
    assert FrameRun.of(landing, [codec.open(s) for s in slots]) is not None
    context = torch.full((geo.num_layers, 2, geo.kv_heads, cached + 16, geo.head_dim), float("nan"), dtype=geo.dtype)
    context[:, :, :, 3 * b:cached] = full.kv[:, :, :, 3 * b:cached]  # the tail, as the lookup decodes it
    rehydration = Rehydration(context, b, lambda frame, i: codec.open(frame), layerwise=True, landing=landing)
    rehydration.take(slots)
    rehydration.end()
    rehydration.run(lambda n, nbytes: None)
    return prompt, full, context, rehydration, cached


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_the_first_step_reads_cached_layers_from_a_scratch(tiny_model: object, max_tokens: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit whose frames landed, and a prompt tail decoded into the context (a session's partial block): the first
    forward step reads each layer's cached tokens from a scratch the gate fills just before the layer's attention,
    and the context buffer gets the landed ones only at the second step. The reply is the one of a full prefill
    either way; a one-token reply, whose write-back starts at the tail, never writes them at all."""
    monkeypatch.setattr(kernels, "ENABLED", False)  # no kernel: no attention over the codes, the scratch instead
    engine = HfEngine(tiny_model)  # type: ignore[arg-type]
    b = 16
    prompt, full, context, rehydration, cached = _landed_hit(engine, "exact", 1, max_tokens)  # bit-exact frames
    gen = engine.generate(GenRequest(prompt, context[:, :, :, :cached], GenParams(max_tokens=max_tokens),
                          kv_ready=rehydration.gate, keep_from=3 * b))  # the pipeline's: from the first block not read
    assert gen.cached_tokens == cached and gen.token_ids == full.token_ids
    assert gen.kv is not None and torch.allclose(gen.kv, full.kv[:, :, :, 3 * b:], atol=1e-5)
    if max_tokens == 1:
        assert context[:, :, :, :3 * b].isnan().all()
    else:
        assert torch.equal(context[:, :, :, :3 * b], full.kv[:, :, :, :3 * b])
    again = engine.generate(GenRequest(prompt, context[:, :, :, :cached], GenParams(max_tokens=max_tokens),
                            kv_ready=rehydration.gate))
    assert again.token_ids == full.token_ids and again.kv is not None
    assert torch.allclose(again.kv, full.kv, atol=1e-5)  # the write-back's whole range too: the cached part settled


@pytest.mark.skipif(not kernels.enabled(), reason="no native kernel on this CPU or build")
@pytest.mark.parametrize("spec", ["int8", "int4", "fp16", "exact"])
@pytest.mark.parametrize("new", [1, 3, ATTEND_MAX_NEW + 2])
def test_the_first_step_attends_over_the_landed_codes(tiny_model: object, spec: str, new: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With a kernel and up to ATTEND_MAX_NEW new tokens, the first step's attention reads each layer's cached tokens
    from the frames where they landed (codec.attend), the tail and the new tokens from the context: nothing is
    dequantized, and the reply and its KV are the scratch path's (to float rounding). More new tokens: the scratch."""
    engine = HfEngine(tiny_model)  # type: ignore[arg-type]
    layers, b = engine.geometry.num_layers, 16
    attended: list[int] = []
    real = in_codes.attention

    def counted(*args: object) -> torch.Tensor | None:
        out = real(*args)  # type: ignore[arg-type]
        attended.append(out is not None)
        return out

    monkeypatch.setattr(in_codes, "attention", counted)
    prompt, _, context, rehydration, cached = _landed_hit(engine, spec, new, 1)
    gen = engine.generate(GenRequest(prompt, context[:, :, :, :cached], GenParams(max_tokens=3),
                                     kv_ready=rehydration.gate))
    assert attended == ([True] * layers if new <= ATTEND_MAX_NEW else [])
    assert not context[:, :, :, :3 * b].isnan().any()  # the second step put them in place

    monkeypatch.setattr(kernels, "ENABLED", False)
    prompt, _, context, rehydration, cached = _landed_hit(engine, spec, new, 1)
    scratch = engine.generate(GenRequest(prompt, context[:, :, :, :cached], GenParams(max_tokens=3),
                                         kv_ready=rehydration.gate))
    assert len(attended) == (layers if new <= ATTEND_MAX_NEW else 0)  # no kernel: not attended over the codes
    assert gen.token_ids == scratch.token_ids and gen.kv is not None and scratch.kv is not None
    assert torch.allclose(gen.kv, scratch.kv, atol=1e-5)


@pytest.mark.skipif(not kernels.enabled(), reason="no native kernel on this CPU or build")
def test_a_model_in_bf16_reads_the_first_step_from_the_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention kernels take fp32 queries: a pod running its model in another dtype keeps the scratch, and its
    reply is the one it gives with no kernel at all."""
    from service.engines.hf.models import load_model  # noqa: PLC0415

    engine = HfEngine(load_model("tiny-random", dtype=torch.bfloat16))
    attended: list[object] = []
    real = in_codes.attention
    monkeypatch.setattr(in_codes, "attention", lambda *args: attended.append(args) or real(*args))
    prompt, _, context, rehydration, cached = _landed_hit(engine, "int8", 1, 1)
    gen = engine.generate(GenRequest(prompt, context[:, :, :, :cached], GenParams(max_tokens=3),
                                     kv_ready=rehydration.gate))
    assert attended == []
    monkeypatch.setattr(kernels, "ENABLED", False)
    prompt, _, context, rehydration, cached = _landed_hit(engine, "int8", 1, 1)
    scratch = engine.generate(GenRequest(prompt, context[:, :, :, :cached], GenParams(max_tokens=3),
                                         kv_ready=rehydration.gate))
    assert gen.token_ids == scratch.token_ids and torch.equal(gen.kv, scratch.kv)
