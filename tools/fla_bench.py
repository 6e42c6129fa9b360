#!/usr/bin/env python3
"""fla's (flash-linear-attention, fla-core) KDA kernels timed at BerryLM-OS shapes (issue #6).

Usage (on the GPU machine; tools/gpu-suite.sh's `fla` step unpacks the wheels and sets PYTHONPATH):

    python3 tools/fla_bench.py [--prefill 1x512,1x4096,1x16384,4x8192] [--decode 1,8,32,64,256]
                               [--qk-norm both|kernel|pre] [--beta-dtype fp32|bf16] [--safe-gate]
                               [--warmup 3] [--repeats 30] [--inner-prefill 5] [--inner-decode 20]
                               [--no-graph] [--no-check] [--tma] [--allow-backends] [--seed 0]
                               [--json OUT]

Shapes: q/k heads H = 16, value heads HV = 32, head dims K = V = 128; q, k, v bf16; g (per-channel
log-decay, [B, T, HV, K]) fp32; beta [B, T, HV] fp32 (--beta-dtype); recurrent state fp32
[N, HV, K, V], always passed as the initial state and returned as the final state.

* prefill: `fla.ops.kda.chunk_kda` (fla/ops/kda/chunk.py:216 in fla-core 0.6.0) at B x T from
  --prefill ("BxT" items; "none" skips), output_final_state=True.
* decode: one token for each of N sequences (q [N, 1, H, K], ...), two ways:
  - `fused_recurrent_kda` (fla/ops/kda/fused_recurrent.py:338), the public API: it always calls
    the forward with inplace_final_state=False (fused_recurrent.py:480), so each call reads the
    initial state, writes a new final state and allocates a zeroed output (torch.zeros_like(v),
    fused_recurrent.py:270: one memset launch more);
  - `fused_recurrent_kda_fwd` (fused_recurrent.py:236), the internal forward the public API wraps,
    with inplace_final_state=True (the state updated in place) and a preallocated `out`: the
    serving-style call (what vLLM-like decode loops use).
  GB/s counts only the state: N * HV * K * V * 4 bytes read + the same written, per call. Note
  that for N <= 8 the state (2 MiB per sequence) fits in the H200's 50 MiB L2 cache and stays
  there between back-to-back calls, so those GB/s can exceed HBM bandwidth.

GVA (16 q/k heads, 32 value heads): fla supports it natively, q/k are passed with H = 16 heads and
NOT repeated. chunk_kda asserts HV % H == 0 (chunk.py:490) and g/beta have HV heads
(chunk.py:494-495); every kernel maps value head i_hv to q/k head i_hv // (HV // H)
(fused_recurrent.py:89, chunk_intra.py:84, wy_fast.py:62, gla/chunk.py:388,
common/chunk_delta_h.py:120): value heads 2j and 2j+1 share q/k head j, i.e. q/k
repeat_interleave'd, the same grouping as berrylm-kernels' kda_recurrence (value head j reads key
head j / (Hv / Hk)).

Inputs follow fla's own KDA tests (tests/ops/test_kda.py): g = logsigmoid(randn) in fp32
(= -softplus(-randn): per-step decays exp(g) in (0, 1), median 0.5), beta = sigmoid(randn), q, k,
v = randn; the initial state randn * 0.1. q/k normalisation (--qk-norm): `kernel` passes raw q/k
with use_qk_l2norm_in_kernel=True, the same work as berrylm's kda_recurrence (L2 norm inside the
op; chunk_kda runs it as two extra l2norm kernels, fused_recurrent_kda inside its one kernel);
`pre` passes q/k already L2-normalised with the flag off; `both` (default) times chunk_kda both
ways. Decode always uses the in-kernel flag (fused into the one kernel, no extra launch).
scale = K ** -0.5 (fla's default, as ours). --safe-gate clamps g to [-5, 0) and passes
safe_gate=True (fla's bounded-gate fast path; off by default, as BerryLM's kda_safe_gate=false).

Timing: CUDA events. Every case runs --warmup calls first (Triton compiles and autotunes on the
first call; excluded), then --repeats loops of --inner-* back-to-back calls, each loop timed with
a pair of events: ms per call = loop time / calls; the table gives the median (and the minimum)
over the loops. "eager" is the plain Python call loop, host overhead included when the GPU waits
for the launches; "graph" captures the calls (--inner-decode of them for decode, one for prefill)
in a CUDA graph and times its replays the same way: GPU time without Python/launch overhead
(--no-graph skips it; a capture failure is reported, not fatal).

By default fla's backend dispatch is off (FLA_DISABLE_BACKEND_DISPATCH=1, set before importing
fla), so chunk_kda always runs fla's Triton kernels (FlashKDA/TileLang backends, if installed,
would otherwise be chosen for some calls; FlashKDA rejects GVA anyway). --allow-backends keeps
dispatch on. --tma sets FLA_USE_TMA=1 (fla's default is 0; fla's own benchmark_kda.py sets 1).
An environment value set by the caller wins over both defaults.

Two sanity checks run before the timings (--no-check skips them): fused_recurrent_kda vs chunk_kda
at B = 1, T = 512 (output and final state; relative max and RMS error, the check fails above an
RMS ratio of 0.02, fla's own tests accept 0.005) and the in-place decode forward vs the public
decode API at N = 8 (the same kernel: expected identical, the state updated in place).

The issue's anchors on this H200 (fla-core 0.6.0; shown next to the results, not asserted):
chunk_kda B1 T512 0.74 ms, B1 T4096 0.88 ms, B1 T16384 2.12 ms, B4 T8192 4.15 ms;
fused_recurrent_kda N = 1, 8, 32, 64 about 101-104 us each, N = 256 277 us.

Exit status: 0 when every case ran, 1 when a case or check failed (the others still run and the
JSON is still written), 2 on bad arguments, 3 when torch/CUDA/triton/fla cannot be imported or no
GPU is visible.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

H, HV, K, V = 16, 32, 128, 128

ANCHORS_MS = {
    ("chunk_kda", 1, 512): 0.74,
    ("chunk_kda", 1, 4096): 0.88,
    ("chunk_kda", 1, 16384): 2.12,
    ("chunk_kda", 4, 8192): 4.15,
    ("fused_recurrent_kda", 1, 1): 0.101,
    ("fused_recurrent_kda", 8, 1): 0.104,
    ("fused_recurrent_kda", 32, 1): 0.104,
    ("fused_recurrent_kda", 64, 1): 0.104,
    ("fused_recurrent_kda", 256, 1): 0.277,
}
ANCHOR_NOTE = ("issue #6 anchors, fla-core 0.6.0 on this H200; fused_recurrent_kda N=1..64 were given "
               "as 'about 101-104 us each'")


def parse_args(argv):
    parser = argparse.ArgumentParser(description="fla chunk_kda / fused_recurrent_kda timings at BerryLM-OS shapes")
    parser.add_argument("--prefill", default="1x512,1x4096,1x16384,4x8192",
                        help="comma-separated BxT for chunk_kda, or 'none'")
    parser.add_argument("--decode", default="1,8,32,64,256",
                        help="comma-separated sequence counts N for one-token decode, or 'none'")
    parser.add_argument("--qk-norm", choices=("both", "kernel", "pre"), default="both",
                        help="chunk_kda: L2 norm of q/k in fla (use_qk_l2norm_in_kernel) or beforehand")
    parser.add_argument("--beta-dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--safe-gate", action="store_true",
                        help="clamp g to [-5, 0) and pass safe_gate=True to chunk_kda")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--inner-prefill", type=int, default=5, help="calls per timed loop, prefill")
    parser.add_argument("--inner-decode", type=int, default=20, help="calls per timed loop, decode")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    parser.add_argument("--no-check", action="store_true", help="skip the sanity checks")
    parser.add_argument("--tma", action="store_true", help="FLA_USE_TMA=1 (set before importing fla)")
    parser.add_argument("--allow-backends", action="store_true",
                        help="keep fla's backend dispatch (FlashKDA/TileLang when installed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.repeats < 1 or args.inner_prefill < 1 or args.inner_decode < 1:
        parser.error("--warmup (>= 1: it excludes Triton's compilation), --repeats and --inner-* must be >= 1")
    try:
        args.prefill_shapes = [] if args.prefill == "none" else [
            tuple(int(x) for x in item.lower().split("x")) for item in args.prefill.split(",")]
        args.decode_counts = [] if args.decode == "none" else [int(n) for n in args.decode.split(",")]
    except ValueError:
        parser.error("--prefill takes BxT items like 1x4096,4x8192 and --decode integers like 1,8,64")
    if any(len(s) != 2 or min(s) < 1 for s in args.prefill_shapes) or any(n < 1 for n in args.decode_counts):
        parser.error("--prefill items must be BxT with B, T >= 1; --decode counts >= 1")
    return args


def fail_import(what, error):
    print(f"fla_bench: cannot import {what}: {type(error).__name__}: {error}", file=sys.stderr)
    print(f"  python {sys.executable} {platform.python_version()}", file=sys.stderr)
    print(f"  PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}", file=sys.stderr)
    if what == "fla":
        print("  fla comes from the fla-core wheel (plus einops and packaging, which fla imports) unzipped "
              "onto PYTHONPATH; tools/gpu-suite.sh fla does that from $FLA_WHEELS (default .gpu3):\n"
              "    pip download fla-core==0.6.0 einops packaging --no-deps -d .gpu3", file=sys.stderr)
        traceback.print_exc()
    sys.exit(3)


def main(argv):
    args = parse_args(argv)

    # fla reads these at import time.
    if not args.allow_backends:
        os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    if args.tma:
        os.environ.setdefault("FLA_USE_TMA", "1")

    try:
        import torch
        import torch.nn.functional as F
    except Exception as error:  # noqa: BLE001 - any import failure is fatal and reported
        fail_import("torch", error)
    if not torch.cuda.is_available():
        print(f"fla_bench: torch {torch.__version__} sees no CUDA device "
              f"(torch.version.cuda={torch.version.cuda})", file=sys.stderr)
        sys.exit(3)
    try:
        import triton
    except Exception as error:  # noqa: BLE001
        fail_import("triton", error)
    try:
        import fla
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as error:  # noqa: BLE001
        fail_import("fla", error)
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError as error:
        fused_recurrent_kda_fwd = None
        print(f"note: no fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd ({error}); "
              "the in-place decode variant is skipped", file=sys.stderr)

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    env_keys = ("FLA_DISABLE_BACKEND_DISPATCH", "FLA_USE_TMA", "FLA_FLASH_KDA", "FLA_TILELANG",
                "FLA_CACHE_MODE", "TRITON_CACHE_DIR", "TRITON_F32_DEFAULT", "CUDA_VISIBLE_DEVICES")
    report = {
        "versions": {"fla": getattr(fla, "__version__", "?"), "fla_path": os.path.dirname(fla.__file__),
                     "torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton.__version__,
                     "python": platform.python_version()},
        "device": {"name": props.name, "capability": f"{props.major}.{props.minor}",
                   "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1)},
        "env": {key: os.environ[key] for key in env_keys if key in os.environ},
        "config": {"H": H, "HV": HV, "K": K, "V": V, "qk_dtype": "bf16", "v_dtype": "bf16", "g_dtype": "fp32",
                   "beta_dtype": args.beta_dtype, "state_dtype": "fp32", "qk_norm": args.qk_norm,
                   "safe_gate": args.safe_gate, "warmup": args.warmup, "repeats": args.repeats,
                   "inner_prefill": args.inner_prefill, "inner_decode": args.inner_decode,
                   "graph": not args.no_graph, "seed": args.seed,
                   "gva": "native: q/k H=16 heads, value head i uses q/k head i // (HV // H)"},
        "anchor_note": ANCHOR_NOTE,
        "checks": [], "results": [], "errors": [],
    }
    ver = report["versions"]
    print(f"fla {ver['fla']} ({ver['fla_path']}), torch {ver['torch']} (CUDA {ver['torch_cuda']}), "
          f"triton {ver['triton']}, python {ver['python']}; {props.name} "
          f"(sm_{props.major}{props.minor}, {props.multi_processor_count} SMs)")
    print(f"env: {report['env']}")
    print(f"shapes: H {H} q/k heads, HV {HV} value heads (GVA, not repeated), K {K}, V {V}; q/k/v bf16, g fp32, "
          f"beta {args.beta_dtype}, state fp32")

    beta_dtype = torch.float32 if args.beta_dtype == "fp32" else torch.bfloat16
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    def inputs(b, t, n_state, prenorm):
        q = randn(b, t, H, K)
        k = randn(b, t, H, K)
        if prenorm:
            q, k = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
        v = randn(b, t, HV, V, dtype=torch.bfloat16)
        g = F.logsigmoid(randn(b, t, HV, K))
        if args.safe_gate:
            g = g.clamp_(min=-5.0)
        beta = torch.sigmoid(randn(b, t, HV)).to(beta_dtype)
        h0 = randn(n_state, HV, K, V) * 0.1
        return q, k, v, g, beta, h0

    def loop_ms(run, calls_per_run, label):
        """Median and min ms per call over --repeats event-timed runs of `run`."""
        per_call = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / calls_per_run)
        if not all(x > 0 for x in per_call):
            raise RuntimeError(f"{label}: non-positive event timings {per_call[:5]}")
        return statistics.median(per_call), min(per_call)

    def time_eager(fn, inner, label):
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()

        def run():
            for _ in range(inner):
                fn()
        return loop_ms(run, inner, label)

    def time_graph(fn, calls, replays, label):
        """`calls` calls of fn captured in one CUDA graph; each timed loop replays it `replays` times."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()

        def run():
            for _ in range(replays):
                graph.replay()
        try:
            return loop_ms(run, calls * replays, label)
        finally:
            del graph

    def measure(row, fn, inner, graph_calls, graph_replays, state_bytes):
        label = f"{row['op']} {row['variant']} {row['shape']}"
        t0 = time.time()
        fn()  # the first call compiles and autotunes (host time only, not in the timings)
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.time() - t0, 3)
        row["eager_ms"], row["eager_min_ms"] = time_eager(fn, inner, label)
        if not args.no_graph:
            try:
                row["graph_ms"], row["graph_min_ms"] = time_graph(fn, graph_calls, graph_replays, label)
            except Exception as error:  # noqa: BLE001 - reported, not fatal
                row["graph_error"] = f"{type(error).__name__}: {error}"
                print(f"  graph capture failed for {label}: {row['graph_error']}", file=sys.stderr)
                torch.cuda.synchronize()
        if state_bytes:
            row["state_bytes_per_call"] = state_bytes
            row["state_gbps_eager"] = state_bytes / (row["eager_ms"] * 1e-3) / 1e9
            if "graph_ms" in row:
                row["state_gbps_graph"] = state_bytes / (row["graph_ms"] * 1e-3) / 1e9
        print(f"  {label}: eager {row['eager_ms']:.4f} ms"
              + (f", graph {row['graph_ms']:.4f} ms" if "graph_ms" in row else "")
              + f" (first call {row['first_call_s']} s)", flush=True)

    def run_case(row, body):
        try:
            body(row)
            report["results"].append(row)
        except Exception as error:  # noqa: BLE001 - reported, the other cases still run
            message = f"{row['op']} {row.get('variant', '')} {row['shape']}: {type(error).__name__}: {error}"
            print(f"ERROR {message}", file=sys.stderr)
            traceback.print_exc()
            report["errors"].append(message)
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def rel_errors(ref, out):
        """(max |ref - out| / max |ref|, rms(ref - out) / rms(ref)); the second is fla's assert_close ratio."""
        ref, out = ref.float(), out.float()
        diff = ref - out
        return ((diff.abs().max() / ref.abs().max().clamp_min(1e-30)).item(),
                (diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item())

    with torch.inference_mode():
        if not args.no_check:
            print("checks:", flush=True)
            try:
                q, k, v, g, beta, h0 = inputs(1, 512, 1, prenorm=False)
                o_c, ht_c = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, safe_gate=args.safe_gate)
                o_r, ht_r = fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
                (o_max, o_rms), (ht_max, ht_rms) = rel_errors(o_r, o_c), rel_errors(ht_r, ht_c)
                check = {"name": "chunk_kda vs fused_recurrent_kda, B1 T512",
                         "o_rel_max_err": o_max, "o_rel_rms_err": o_rms,
                         "state_rel_max_err": ht_max, "state_rel_rms_err": ht_rms,
                         "finite": bool(torch.isfinite(o_c).all() and torch.isfinite(ht_c).all())}
                report["checks"].append(check)
                print(f"  {check}")
                if not check["finite"] or max(o_rms, ht_rms) > 0.02:
                    report["errors"].append(f"check failed: {check}")
                if fused_recurrent_kda_fwd is not None:
                    q, k, v, g, beta, h0 = inputs(8, 1, 8, prenorm=False)
                    o_p, ht_p = fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0.clone(),
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
                    state, out = h0.clone(), torch.empty_like(v)
                    o_i, ht_i = fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, initial_state=state,
                                                        output_final_state=True, inplace_final_state=True,
                                                        use_qk_l2norm_in_kernel=True, out=out)
                    check = {"name": "decode in-place fwd vs public API, N8",
                             "o_max_abs_diff": (o_p.float() - o_i.float()).abs().max().item(),
                             "state_max_abs_diff": (ht_p - state).abs().max().item(),
                             "state_updated_in_place": ht_i.data_ptr() == state.data_ptr(),
                             "state_changed": not torch.equal(state, h0)}
                    report["checks"].append(check)
                    print(f"  {check}")
                    if check["o_max_abs_diff"] > 1e-2 or check["state_max_abs_diff"] > 1e-5 \
                            or not check["state_updated_in_place"] or not check["state_changed"]:
                        report["errors"].append(f"check failed: {check}")
            except Exception as error:  # noqa: BLE001
                report["errors"].append(f"checks: {type(error).__name__}: {error}")
                print(f"ERROR checks: {type(error).__name__}: {error}", file=sys.stderr)
                traceback.print_exc()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

        print("prefill (chunk_kda):", flush=True)
        norms = {"both": ("kernel", "pre"), "kernel": ("kernel",), "pre": ("pre",)}[args.qk_norm]
        for b, t in args.prefill_shapes:
            for norm in norms:
                row = {"op": "chunk_kda", "variant": f"qk-norm {norm}" + (", safe_gate" if args.safe_gate else ""),
                       "shape": f"B{b} T{t}", "B": b, "T": t, "N": b, "qk_norm": norm,
                       "anchor_ms": ANCHORS_MS.get(("chunk_kda", b, t))}

                def body(row, b=b, t=t, norm=norm):
                    q, k, v, g, beta, h0 = inputs(b, t, b, prenorm=(norm == "pre"))

                    def fn():
                        return chunk_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=(norm == "kernel"), safe_gate=args.safe_gate)
                    measure(row, fn, args.inner_prefill, 1, args.inner_prefill, 0)
                run_case(row, body)

        print("decode (one token per sequence):", flush=True)
        for n in args.decode_counts:
            state_bytes = 2 * n * HV * K * V * 4
            row = {"op": "fused_recurrent_kda", "variant": "public API, new final state", "shape": f"N{n} T1",
                   "B": n, "T": 1, "N": n, "qk_norm": "kernel",
                   "anchor_ms": ANCHORS_MS.get(("fused_recurrent_kda", n, 1))}

            def body(row, n=n, state_bytes=state_bytes):
                q, k, v, g, beta, h0 = inputs(n, 1, n, prenorm=False)

                def fn():
                    return fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0,
                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
                measure(row, fn, args.inner_decode, args.inner_decode, 5, state_bytes)
            run_case(row, body)

            if fused_recurrent_kda_fwd is None:
                continue
            row = {"op": "fused_recurrent_kda_fwd", "variant": "in-place state, preallocated out",
                   "shape": f"N{n} T1", "B": n, "T": 1, "N": n, "qk_norm": "kernel", "anchor_ms": None}

            def body(row, n=n, state_bytes=state_bytes):
                q, k, v, g, beta, state = inputs(n, 1, n, prenorm=False)
                out = torch.empty_like(v)

                def fn():
                    return fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, initial_state=state,
                                                   output_final_state=True, inplace_final_state=True,
                                                   use_qk_l2norm_in_kernel=True, out=out)
                measure(row, fn, args.inner_decode, args.inner_decode, 5, state_bytes)
                if not bool(torch.isfinite(state).all()):
                    raise RuntimeError("the in-place state became non-finite")
            run_case(row, body)

    print_table(report, args)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
            out.write("\n")
    if report["errors"]:
        print(f"{len(report['errors'])} error(s):", file=sys.stderr)
        for message in report["errors"]:
            print(f"  {message}", file=sys.stderr)
        return 1
    return 0


def print_table(report, args):
    def ms(x):
        return "" if x is None else f"{x:.4f}"

    def gbps(row, key):
        return f"{row[key]:.0f}" if key in row else ""

    c = report["config"]
    print()
    print(f"## fla {report['versions']['fla']} KDA on {report['device']['name']} "
          f"(H {c['H']} / HV {c['HV']} GVA, K {c['K']}, V {c['V']}; bf16 q/k/v, fp32 g, {c['beta_dtype']} beta, "
          f"fp32 state; ms per call, median of {c['repeats']} event-timed loops)")
    print()
    print("| op | variant | shape | eager ms | eager min ms | graph ms | state GB/s eager | state GB/s graph "
          "| issue anchor ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for row in report["results"]:
        graph = ms(row.get("graph_ms")) if "graph_error" not in row else "capture failed"
        print(f"| {row['op']} | {row['variant']} | {row['shape']} | {ms(row['eager_ms'])} | "
              f"{ms(row['eager_min_ms'])} | {graph} | {gbps(row, 'state_gbps_eager')} | "
              f"{gbps(row, 'state_gbps_graph')} | {ms(row['anchor_ms'])} |")
    print()
    print(f"eager: Python call loop ({args.inner_prefill} prefill / {args.inner_decode} decode calls per loop); "
          "graph: the same calls replayed from a CUDA graph (GPU time, no launch overhead). "
          "State GB/s: state bytes read + written per call / time. Anchors: " + report["anchor_note"] + ".")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
