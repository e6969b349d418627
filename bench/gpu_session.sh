#!/usr/bin/env bash
# The GPU measurements issue 36 owes, as named parts, so that one device call runs a chosen
# few of them in order (each under a time limit, each into its own log under OUT):
#
#     bash bench/gpu_session.sh OUT profile                 # next: the verify step against decode
#     bash bench/gpu_session.sh OUT check modes decode      # (~8 min a line, one device call each;
#     bash bench/gpu_session.sh OUT verify prefill moe      #  modes compares with check's outputs
#     bash bench/gpu_session.sh OUT sweep                   #  in the same OUT)
#
# Done on an H100 (BENCHMARKS.md, 2026-12-07): every part but startup and autotune (2026-12-06).
#
# Parts:
#   check    bench.check.gpu_check: Pallas == jnp greedy (small preset, fp32 / bf16) and the
#            speculative engines (trained model, spec_steps 1 and 3) == plain greedy
#   modes    gpu_check again under XLA_FLAGS=...scheduling_mode=SERIALIZE, its outputs compared
#            byte for byte with check's (CONCURRENT command buffers must not change a result;
#            run after check)
#   decode   bench.serve.serve decode at B = 1 and 32, K = 8 (the merged decode levers in the engine loop,
#            CONCURRENT command buffers as the steps compile by default)
#   verify   bench.serve.serve verify at B = 1 and 8, the few-token kernel bound 1/3 (the library's) against 1/2
#   prefill  bench.serve.serve prefill at 8 x 1k and 1 x 8k: Pallas grouped GEMMs against ragged_dot
#   moe      bench.kernels.moe_micro --many: dense, ragged_dot and the grouped-GEMM tilings
#   spec     bench.serve.serve spec: the shipped model's speculation at B = 1 and 8, verify dispatches of one
#            round and of decode_steps 'auto' (8) rounds side by side, against plain decode
#   profile  bench.profile.engine at B = 1 (decode, K = 8) and a B = 1 verify step (spec_steps 3), the top 120
#            kernels of each (every launch of a layer: what the next launch cut is)
#   startup  bench.serve.startup (make run's job, shipped model, fresh processes: cold, then warm x3) and
#            bench.serve.serve's startup section (bench preset) with the background warm-up, first as
#            the steps compile by default, then under --xla_gpu_autotune_level=0 (cold compile cost
#            against step time: the same decode and prefill cases side by side in `autotune`)
#   autotune bench.serve.serve decode (B = 1, 32) and prefill (Pallas) without / with autotune level 0
#   sweep    bench.kernels.kernels at batch 1 with the MoE gate|up tile sweep, then (sweep_proj, also a
#            part of its own) the batch-1 projections' tile / split sweep (splits=1: no summing launch)
#   flags    the decode section (B = 1, 32, K = 8) in a fresh process per XLA_FLAGS variant: $FLAG_VARIANTS
#            (';'-separated) or the while-loop / copy-insertion knobs in LOOP_FLAGS
#   matvec_tiles  bench.kernels.matvec_tiles: the grouped mat-vec's tiles / warps / splits on the batch-1
#            expert products against the same-size copy, then the engine's joined expert call per tiling
#   tiles    decode (B = 1, 32) as the library is, then the GPU check of a copy of the tree whose
#            grouped mat-vec module constants are $MATVEC_TILES (pallas_kernels/moe/pallas.py; e.g.
#            "TF=256 BH=32", or "MAX_UNROLL=0 NUM_STAGES=3" for the pipelined loop), then decode
#            library / copy / library / copy (the first run after the check is slow whatever the
#            tree); ~9 min, one device call
#   verify_convs  as tiles, timing verify (B = 1, 8) for a copy with inkling_jax/steps/context.py's
#            FUSED_DEFERRED_CONVS = True (verify's target pass convs by the conv kernels, computing only)
#   ab       decode (B = 1, 32, K = 8) of the tree at $AB_BASE (a copy of bench/, inkling_jax/,
#            pallas_kernels/ of the base commit, e.g. `git archive HEAD bench inkling_jax
#            pallas_kernels | tar -x -C ab/base`) and of this tree, alternating base / this / base /
#            this on one warm machine, one compilation cache (keyed by the programs: the trees' steps
#            do not mix); the first decode after `check` is 5-7 % slow, the second alternation is the
#            clean one. AB_TIMING=verify_part times the verify section instead (B = 1, 8: single-step
#            decode and verify dispatches): e.g. against 632bd93, whose batch-1 decode dispatch took
#            2.79 ms on 2026-12-06 where fcd42cf's and 7777748's took 3.9-4.1 ms (H100)
# Every part's command is printed before it runs; a part that fails or times out is reported
# and the next one runs. bench.serve.serve's compiles go to the persistent cache $GPU_SESSION_CACHE
# (default /tmp/gpu_session_cache): later parts and calls on a warm machine reuse them.
# The parts run as modules (`python -m bench.<subject>.<script>`) from the repository root.
set -uo pipefail
OUT=${1:?usage: bench/gpu_session.sh OUT PART [PART ...]}
shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: a part may run from a copy of the tree
cd "$(dirname "$0")/.."
CACHE=${GPU_SESSION_CACHE:-/tmp/gpu_session_cache}
# the flags part's default variants: XLA's knobs for the decode dispatch's while loop (K token
# steps) and its copies, each against the inherited flags (the empty first variant)
LOOP_FLAGS=";--xla_gpu_command_buffer_unroll_loops=true;--xla_gpu_copy_insertion_use_region_analysis=true"
LOOP_FLAGS+=";--xla_gpu_enable_while_loop_double_buffering=true"

run_part() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $((SECONDS - t0)) s; last lines:"
    tail -n 25 "$OUT/$name.log"
}

decode_part() {  # name, cache dir: bench.serve.serve decode at B = 1 and 32, K = 8, into $OUT/<name>.md
    run_part "$1" 240 python -m bench.serve.serve --sections decode --decode-batches 1,32 --decode-steps 8 \
        --cache-dir "$2" --out "$OUT/$1.md"
}

verify_part() {  # name, cache dir: bench.serve.serve verify at B = 1 and 8 (the library's few-token bound)
    run_part "$1" 300 python -m bench.serve.serve --sections verify --decode-batches 1,8 --few-token-bounds 0.3333 \
        --cache-dir "$2" --out "$OUT/$1.md"
}

variant_part() {  # name, module file, "NAME=VALUE ...", [timing part, default decode_part]: the timing as the
    # library is, then the GPU check of a copy of the tree whose module globals NAME are set to VALUE, then
    # the timing library / copy / library / copy (the first decode after the ~5-minute check is 5-7 % slow
    # whatever the tree, H100, sessions 12-13: the library runs once more first); the timings run whatever
    # the check says (its log says)
    local name=$1 file=$2 settings=$3 timing=${4:-decode_part} tree=/tmp/gpu_session_variant kv
    $timing "time_library" ""
    rm -rf "$tree" && mkdir -p "$tree" && cp -r bench inkling_jax pallas_kernels "$tree"/
    for kv in $settings; do
        sed -i "s/^${kv%%=*} = [A-Za-z0-9_.]*/${kv%%=*} = ${kv#*=}/" "$tree/$file"
        grep -q "^${kv%%=*} = ${kv#*=}\b" "$tree/$file" || { echo "$name: sed $kv in $file failed"; return 1; }
    done
    (cd "$tree" && run_part "${name}_check" 420 python -m bench.check.gpu_check --outputs-out "$OUT/check_$name.json")
    $timing time_after_check ""
    (cd "$tree" && $timing "time_$name" "")
    $timing time_library2 ""
    (cd "$tree" && $timing "time_${name}2" "")
}

for part in "$@"; do
    case $part in
        check) run_part check 480 python -m bench.check.gpu_check --outputs-out "$OUT/check.json" ;;
        modes)
            XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_command_buffer_scheduling_mode=SERIALIZE" \
                run_part modes 480 python -m bench.check.gpu_check --outputs-out "$OUT/check_serialize.json"
            if cmp "$OUT/check.json" "$OUT/check_serialize.json"; then
                echo "== modes: outputs equal (CONCURRENT vs SERIALIZE)"
            else
                echo "== modes: OUTPUTS DIFFER (CONCURRENT vs SERIALIZE)"
            fi ;;
        decode) decode_part decode "$CACHE" ;;
        verify) run_part verify 300 python -m bench.serve.serve --sections verify --decode-batches 1,8 \
            --few-token-bounds 0.3333,0.5 --cache-dir "$CACHE" --out "$OUT/verify.md" ;;
        prefill) run_part prefill 300 python -m bench.serve.serve --sections prefill --prefill-kernels pallas,ragged \
            --cache-dir "$CACHE" --out "$OUT/prefill.md" ;;
        spec) run_part spec 400 python -m bench.serve.serve --sections spec --cache-dir "$CACHE" --out "$OUT/spec.md" ;;
        moe) run_part moe 150 python -m bench.kernels.moe_micro --many ;;
        profile)
            run_part profile_decode 150 python -m bench.profile.engine --batch 1 --top 120 --hlo-out "$OUT/decode_hlo.txt"
            run_part profile_verify 150 python -m bench.profile.engine --batch 1 --spec-steps 3 --top 120 \
                --hlo-out "$OUT/verify_hlo.txt" ;;
        startup)
            run_part startup_make_run 300 python -m bench.serve.startup --cold-runs 1 --warm-runs 3
            run_part startup_bench 300 python -m bench.serve.serve --sections startup --startup-warmup \
                --out "$OUT/startup.md"
            XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" run_part startup_autotune0 300 \
                python -m bench.serve.serve --sections startup --startup-warmup --out "$OUT/startup_autotune0.md" ;;
        autotune)
            run_part autotune_decode 300 python -m bench.serve.serve --sections flags --cache-dir "" \
                --decode-steps 8 --flag-batches 1,32 --flag-variants ';--xla_gpu_autotune_level=0' \
                --out "$OUT/autotune_decode.md"
            run_part prefill_default 240 python -m bench.serve.serve --sections prefill --prefill-kernels pallas \
                --cache-dir "" --out "$OUT/prefill_default.md"
            XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" run_part prefill_autotune0 240 \
                python -m bench.serve.serve --sections prefill --prefill-kernels pallas --cache-dir "" \
                --out "$OUT/prefill_autotune0.md" ;;
        sweep)  # two parts: the MoE sweep alone outran one 400 s limit on an H100 (2026-12-07)
            run_part sweep_moe 400 python -m bench.kernels.kernels --batches 1 --moe-sweep --out "$OUT/sweep_moe.md"
            ;&  # then sweep_proj
        sweep_proj) run_part sweep_proj 400 python -m bench.kernels.kernels --batches 1 --proj-sweep \
            --out "$OUT/sweep_proj.md" ;;
        flags) run_part flags 560 python -m bench.serve.serve --sections flags --flag-batches 1,32 --decode-steps 8 \
            --cache-dir "" --flag-variants "${FLAG_VARIANTS:-$LOOP_FLAGS}" --out "$OUT/flags.md" ;;
        matvec_tiles) run_part matvec_tiles 480 python -m bench.kernels.matvec_tiles --budget 400 \
            --out "$OUT/matvec_tiles.md" ;;
        tiles)  # the grouped mat-vec's module defaults set to $MATVEC_TILES (e.g. "NUM_WARPS=2 TF=256"),
            # checked and timed in a copy of the tree against decode as the library is: adopt only if
            # the check passes (a new tiling sums the fp32 products in another order)
            variant_part tiles pallas_kernels/moe/pallas.py "${MATVEC_TILES:?tiles needs MATVEC_TILES, e.g. NUM_WARPS=2}" ;;
        verify_convs)  # verify's target pass convs by the kernels (inkling_jax/steps/context.py), checked and timed
            variant_part verify_convs inkling_jax/steps/context.py "FUSED_DEFERRED_CONVS=True" verify_part ;;
        ab)
            base=$(cd "${AB_BASE:?ab needs AB_BASE, a copy of the base tree}" && pwd)
            timing=${AB_TIMING:-decode_part}  # or verify_part: the single-step dispatches of the verify section
            for run in 1 2; do
                (cd "$base" && $timing "${timing%_part}_base$run" "$CACHE")
                $timing "${timing%_part}_this$run" "$CACHE"
            done ;;
        *) echo "unknown part $part (check modes decode verify prefill spec moe profile sweep sweep_proj flags tiles verify_convs matvec_tiles startup autotune ab)"; exit 2 ;;
    esac
done
