"""The subcommands of `kvstash admin` (parsing and plumbing live in ops/admin.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from cachestore import codecplans, inspect, repair, transfer
from cachestore.codec import read_header
from cachestore.errors import CodecError, KvstashError, StoreError
from cachestore.signing import Signer
from ops.admin_console import call, confirm, print_json, progress, size, when


def _where(settings: Any) -> str:
    return f"namespace {settings.namespace!r} at {settings.masked_url}"


def cmd_stats(args: argparse.Namespace, settings: Any) -> int:
    stats = call(settings, lambda s: inspect.namespace_stats(s.client, s.keys, settings.budget_bytes,
                                                              progress(args)))
    stats["tenant_quotas"] = {t: settings.quota_of(t) for t in stats["tenant_bytes"] if settings.quota_of(t)}
    stats["codec_plans"] = call(settings, lambda s: codecplans.stored_plans(s.client, s.keys))
    if args.json:
        print_json(stats)
        return 0
    b, srv = stats["budget"], stats["server"]
    print(f"{_where(settings)} (Redis {srv['redis_version']}, {srv['primaries']} primaries)")
    print(f"{'kind':<9} {'keys':>10} {'memory':>12}")
    for kind, row in stats["kinds"].items():
        print(f"{kind:<9} {row['keys']:>10} {size(row['bytes']):>12}")
    print(f"budget: {size(b['bytes_held'])} accounted of {size(b['budget_bytes'])} ({100 * b['fraction']:.1f}%); "
          f"block values found by SCAN: {size(b['block_value_bytes'])}; dead (chain broken, unreachable): "
          f"{b['dead_blocks']} blocks, {size(b['dead_bytes'])}")
    print(f"server: hits {srv['keyspace_hits']}, misses {srv['keyspace_misses']}, evicted {srv['evicted_keys']}, "
          f"expired {srv['expired_keys']}, used {size(srv['used_memory'])} of maxmemory "
          f"{size(srv['maxmemory']) if srv['maxmemory'] else 'unlimited'} ({srv['maxmemory_policy']})")
    print(f"blocks: least recent access {when(stats['oldest_block_access'])}, "
          f"most recent {when(stats['newest_block_access'])}")
    print(f"sessions: oldest created {when(stats['oldest_session_created'])}, "
          f"last updated {when(stats['newest_session_updated'])}")
    print(f"{'model':<18} {'blocks':>8} {'block bytes':>12} {'sessions':>9}")
    for model, row in stats["models"].items():
        print(f"{model:<18} {row['blocks']:>8} {size(row['block_bytes']):>12} {row['sessions']:>9}")
    if stats["tenants"]:
        print("sessions by tenant: " + ", ".join(f"{t} {n}" for t, n in stats["tenants"].items()))
    if stats["tenant_bytes"]:
        print(f"{'tenant':<18} {'bytes held':>12} {'quota':>12}")
        for tenant, held in stats["tenant_bytes"].items():
            quota = settings.quota_of(tenant)
            print(f"{tenant:<18} {size(held):>12} {size(quota) if quota else 'none':>12}")
    for model, plan in stats["codec_plans"].items():  # what `int4` and `int2` mean for each model
        print(f"codec plan {model}: " + (plan["error"] if "error" in plan else
              "; ".join(f"{name} = {spec}" for name, spec in plan["specs"].items())
              + f" ({plan['source']}; made by {plan['made_by'] or 'a pod'})"))
    return 0


def cmd_sessions(args: argparse.Namespace, settings: Any) -> int:
    rows = call(settings, lambda s: inspect.session_infos(s.client, s.keys, args.tenant, progress(args),
                                                           args.limit))
    if args.json:
        print_json([r.as_dict() for r in rows])
        return 0
    print(f"{'tenant':<12} {'session':<28} {'model':<17} {'tokens':>7} {'ver':>4} {'partial':>9} "
          f"{'updated':<19} {'ttl s':>7}")
    for r in rows:
        ttl = "none" if r.ttl_s is None else f"{r.ttl_s:.0f}"
        print(f"{r.tenant:<12} {r.session_id:<28} {r.model:<17} {r.n_tokens:>7} {r.version:>4} "
              f"{size(r.partial_bytes):>9} {when(r.updated_at):<19} {ttl:>7}")
    print(f"{len(rows)} sessions")
    return 0


def cmd_show(args: argparse.Namespace, settings: Any) -> int:
    record, raw, ttl = call(settings, lambda s: inspect.read_session(s.client, s.keys, args.tenant, args.session))
    if not raw:
        raise StoreError(f"session {args.tenant}/{args.session} not found in {_where(settings)}")
    if record is None:
        raise StoreError(f"session {args.tenant}/{args.session} is malformed (run `kvstash admin verify`)")
    partial: dict[str, Any] | None = None
    if record.partial:
        try:
            h = read_header(record.partial)
            partial = {"bytes": len(record.partial), "mode": h.mode, "compressor": h.compressor,
                       "tokens": h.tokens, "dtype": h.dtype}
        except CodecError as exc:
            partial = {"bytes": len(record.partial), "error": str(exc)}
    info = {"tenant": record.tenant, "session_id": record.session_id, "model": record.model,
            "tokens": len(record.token_ids), "version": record.version, "created_at": record.created_at,
            "updated_at": record.updated_at, "ttl_s": ttl, "partial": partial, "messages": record.messages}
    if args.json:
        print_json({**info, "token_ids": record.token_ids})
        return 0
    for name in ("tenant", "session_id", "model", "tokens", "version"):
        print(f"{name:<11} {info[name]}")
    print(f"{'created':<11} {when(record.created_at)}\n{'updated':<11} {when(record.updated_at)}")
    print(f"{'ttl':<11} {'none' if ttl is None else f'{ttl:.0f} s'}")
    print(f"{'partial':<11} {partial if partial else '-'}")
    print(f"messages ({len(record.messages)}):")
    for m in record.messages:
        content = str(m.get("content", ""))
        print(f"  {str(m.get('role', '?')):<9} {content[:100]}{'...' if len(content) > 100 else ''}")
    return 0


def cmd_delete(args: argparse.Namespace, settings: Any) -> int:
    confirm(args, f"delete session {args.tenant}/{args.session} from {_where(settings)}?")
    key_of = lambda s: s.keys.session(args.tenant, args.session)  # noqa: E731
    deleted = call(settings, lambda s: s.client.delete(key_of(s)))
    if not int(deleted):
        raise StoreError(f"session {args.tenant}/{args.session} not found in {_where(settings)}")
    print(f"deleted session {args.tenant}/{args.session} (its blocks stay: other sessions may share them)")
    return 0


def cmd_verify(args: argparse.Namespace, settings: Any) -> int:
    signer = Signer(settings.frame_key, settings.frame_key_previous) if settings.signed else None
    if args.fix:
        confirm(args, f"repair {_where(settings)} (deletes corrupt blocks and bad session records)?")
    report = call(settings, lambda s: repair.verify(
        s.client, s.keys, fix=args.fix, block_ttl_ms=settings.block_ttl_s * 1000,
        session_ttl_ms=settings.session_ttl_s * 1000, progress=progress(args), signer=signer))
    if args.json:
        print_json(report.as_dict())
    else:
        for f in report.findings[:200]:
            print(f"{f.problem:<18} {'fixed ' if f.fixed else ''}{f.key}: {f.detail}")
        if len(report.findings) > 200:
            print(f"... and {len(report.findings) - 200} more (--json lists them all)")
        print(f"scanned {report.keys_scanned} keys: {report.blocks_ok} blocks and {report.sessions_ok} sessions "
              f"valid, {report.index_entries} index entries; problems: {report.problems or 'none'}"
              + (" (fixed)" if args.fix and report.findings else ""))
        if signer is not None:
            print("signed by the current key: {current}, by the previous key: {previous}".format(
                **{"current": 0, "previous": 0, **report.signed_by}))
    return 1 if report.findings and not args.fix else 0


def cmd_evict(args: argparse.Namespace, settings: Any) -> int:
    if args.to_bytes < 0:
        raise KvstashError("--to-bytes must not be negative")
    confirm(args, f"evict blocks of {_where(settings)} (lowest-scored first) down to {args.to_bytes} bytes?")
    before, result, after = call(settings, lambda s: repair.evict_to(s.client, s.keys, args.to_bytes,
                                                                     reap_dead=s.policy.chained))
    print(f"held {before} bytes; evicted {result.evicted_blocks} blocks ({result.evicted_bytes} bytes), dropped "
          f"{result.stale_blocks} stale index entries; now {after} bytes")
    return 0


def cmd_purge(args: argparse.Namespace, settings: Any) -> int:
    from cachestore.keys import check_model  # noqa: PLC0415

    check_model(args.model)
    confirm(args, f"delete every block and session of model {args.model} in {_where(settings)}?")
    result = call(settings, lambda s: repair.purge_model(s.client, s.keys, args.model, progress(args),
                                                          settings.block_ttl_s * 1000))
    print(f"purged model {args.model}: {result.blocks} blocks ({result.block_bytes} accounted bytes), "
          f"{result.sessions} sessions")
    return 0


def _chain(args: argparse.Namespace, tenant: str, settings: Any) -> transfer.Chain:
    """The chain root of `tenant` under the pods' model settings (loads the model for its fingerprint)."""
    from cachestore.codec import Codec  # noqa: PLC0415
    from cachestore.codec.blockcodec import BlockCodecs  # noqa: PLC0415
    from cachestore.codec.names import is_named  # noqa: PLC0415
    from service.engines import load_engine  # noqa: PLC0415
    from service.settings import settings_from_env  # noqa: PLC0415

    pod = settings_from_env().with_overrides(
        engine=args.engine, model=args.model, codec=args.codec, block_tokens=args.block_tokens, device=args.device)
    print(f"loading model {pod.model} ({pod.engine}) for its fingerprint ...", file=sys.stderr)
    engine = load_engine(pod.engine, pod.model, device=pod.device, parallel=1, codec=pod.codec,
                         flash_attn=pod.flash_attn)  # llama.cpp's V layout decides a pod's /rows
    try:
        codec = pod.codec
        if is_named(codec):  # int4, int2: the spec the model's stored plan gives them, as the pods serve it
            model = engine.fingerprint(pod.block_tokens, "").short()
            plan = call(settings, lambda s: codecplans.stored_plan(s.client, s.keys, model))
            if plan is None:
                raise StoreError(f"no codec plan for model {model} in {_where(settings)}: {codec} means what the "
                                 f"first pod on the model made it; start one, or give the spec")
            codec = plan.spec(codec.strip().lower())
        # the name the pods put in their fingerprint: the block-codec policy (sink block included)
        codecs = BlockCodecs.for_spec(Codec(codec, engine.kv_layout.rope),  # a llama.cpp pod's /rows too
                                      rows=engine.kv_layout.row_frames)
        fingerprint = engine.fingerprint(pod.block_tokens, codecs.name())
    finally:
        engine.close()
    return transfer.Chain.of(fingerprint, pod.tenant_salt(tenant))


def cmd_export(args: argparse.Namespace, settings: Any) -> int:
    chain = _chain(args, args.tenant, settings)
    exported = call(settings, lambda s: transfer.collect(s.client, s.keys, args.tenant, args.session, chain))
    if exported is None:
        raise StoreError(f"session {args.tenant}/{args.session} not found in {_where(settings)}")
    data = transfer.to_document(exported)
    tmp = args.file.with_name(args.file.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, args.file)
    except OSError as exc:
        raise KvstashError(f"cannot write {args.file}: {exc.strerror or exc}") from exc
    missing = exported.full_blocks - len(exported.blocks)
    print(f"exported {args.tenant}/{args.session}: {len(exported.record.token_ids)} tokens, "
          f"{len(exported.blocks)} of {exported.full_blocks} blocks"
          + (f" ({missing} no longer in Redis: they will be recomputed)" if missing else "")
          + (", its boundary record" if exported.boundary else "") + f", {len(data)} bytes to {args.file}")
    return 0


def cmd_import(args: argparse.Namespace, settings: Any) -> int:
    try:
        data = Path(args.file).read_bytes()
    except OSError as exc:
        raise KvstashError(f"cannot read {args.file}: {exc.strerror or exc}") from exc
    exported = transfer.parse_document(data, max_value_bytes=settings.max_value_bytes)
    record = exported.record
    if args.replace:
        confirm(args, f"replace session {record.tenant}/{record.session_id} in {_where(settings)}?")
    chain = _chain(args, record.tenant, settings)
    result = call(settings, lambda s: transfer.restore(s, exported, chain, replace=args.replace))
    print(f"imported {record.tenant}/{record.session_id}: {len(record.token_ids)} tokens, "
          f"{result.blocks_present} of {exported.full_blocks} blocks in Redis ({result.blocks_written} written)")
    return 0
