#!/usr/bin/env bash
# The CUDA paths on a machine with one GPU, in one script for a lent device: the suite's GPU-only tests, then the
# default path measured against predicted on the GPU (measured_vs_predicted.py --gpus 1), then a profile at
# microbatch sizes 1-8 (how far from linear the GPU's times are), then issue 17's schedules simulated on profiles
# made on the GPU (benchmarks/schedules.py: the gpt example, and gpt2-medium), then how much longer a stage's ops take
# after the rank waited (benchmarks/idle_penalty.py --device cuda), then `planner cluster` on this machine (one GPU:
# the one line that says there is no link to measure), then the split's own tests on this machine's torch and
# transformers, and the transformers families trained split and plain on the GPU (benchmarks/model_families.py
# --device cuda). Models as arguments (default below); a section whose *_S variable is 0 is skipped.
#     OUT=folder bash benchmarks/cuda_path.sh [gpt2-medium gpt2 gpt ...]
set -uo pipefail
out=${OUT:-/tmp/cuda-path}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" PLANNER_TEST_GPU=1  # (tests/conftest.py hides GPUs without it)
models=("${@:-gpt2-medium gpt2 gpt}")
python3 -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "transformers", transformers.__version__, torch.cuda.get_device_name())'
if [ "${TESTS_S:-120}" != 0 ]; then
echo "== GPU-only tests"
timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider -k "gpu or cuda" tests/runtime/test_rng.py \
    tests/runtime/test_train.py tests/runtime/test_trace.py tests/runtime/test_pipeline.py tests/planner/profiling/test_backward_split.py \
    tests/planner/profiling/test_profiler.py tests/planner/profiling/test_batch_coupling.py \
    tests/runtime/test_custom_functions.py tests/runtime/test_kept_modules.py tests/runtime/test_checkpointed.py \
    tests/runtime/test_stage_runner.py 2>&1 | tail -25
fi
if [ "${PATH_S:-230}" != 0 ]; then
echo "== measured vs predicted on one GPU"
timeout "${PATH_S:-230}" python3 benchmarks/measured_vs_predicted.py --gpus 1 --schedules 1f1b --steps 12 \
    ${MVP_FLAGS:-} --models ${models[*]} --keep /tmp/mvp 2>&1 | tee "$out/measured_vs_predicted.txt"
cp /tmp/mvp/*.report.json "$out/" 2>/dev/null
cp /tmp/mvp/gpt2-medium.json /tmp/mvp/gpt2-medium-1f1b.report.json "$out/" 2>/dev/null
python3 - ${models[*]} <<'PY'
import sys
from planner.files.profile import load_profile
from planner.files.run_report import load_run_report
print("| model | forward ms measured / profiled | backward ms measured / profiled | forward / backward profiled by one "
      "factor (before 2026-11-27) | instrumented ratio | library MiB |")
print("|---|---|---|---|---|---|")
for model in sys.argv[1:]:
    try:
        profile, report = load_profile(f"/tmp/mvp/{model}.json"), load_run_report(f"/tmp/mvp/{model}-1f1b.report.json")
    except Exception as exc:
        print(f"| {model} | not measured: {exc} | | | | |")
        continue
    found, layers_ms = report.measured[0], profile.total_fwd_ms + profile.total_bwd_ms
    share = profile.settings.get("instrumented_forward_share")
    one_factor = "" if share is None else f"{layers_ms * share:.2f} / {layers_ms * (1 - share):.2f}"
    print(f"| {model} | {found.forward_ms:.2f} / {profile.total_fwd_ms:.2f} | {found.backward_ms:.2f} / "
          f"{profile.total_bwd_ms:.2f} | {one_factor} | {profile.settings.get('instrumented_ratio', 0):.2f} | "
          f"{profile.library_bytes / 2**20:.1f} |")
PY
fi
if [ "${SIZES_S:-60}" != 0 ]; then
echo "== gpt2-medium at microbatch sizes 1, 2, 4, 8"
timeout "${SIZES_S:-60}" python3 -m planner profile benchmarks/models/gpt2_medium.py --batch-size 1,2,4,8 \
    --out "$out/gpt2-medium-sizes.json" 2>&1 | tail -4
python3 - "$out/gpt2-medium-sizes.json" <<'PY'
import sys
from planner.files.profile import load_profile
try:
    profile = load_profile(sys.argv[1])
except Exception as exc:
    sys.exit(f"no profile at sizes 1-8: {exc}")
full = profile.total_fwd_ms + profile.total_bwd_ms
print(f"batch {profile.batch_size}: layers {full:.3f} ms, step {profile.step_ms:.3f} ms")
for sized in profile.size_times:
    layers = sum(sized.fwd_ms) + sum(sized.bwd_ms)
    print(f"batch {sized.batch_size}: layers {layers:.3f} ms, step {sized.step_ms:.3f} ms; "
          f"x{layers / full * profile.batch_size / sized.batch_size:.2f} of linear scaling "
          f"from batch {profile.batch_size}")
PY
fi
echo "== schedules simulated on GPU profiles (the gpt example, then gpt2-medium), microbatches of 8"
[ "${SCHED_S:-150}" = 0 ] || timeout "${SCHED_S:-150}" bash -c "python3 benchmarks/schedules.py 2>&1 | head -12;
    python3 -m planner profile benchmarks/models/gpt2_medium.py --out '$out/gpt2-medium-8.json' 2>&1 | tail -2;
    python3 benchmarks/schedules.py --profile '$out/gpt2-medium-8.json' 2>&1 | head -12" | tee "$out/schedules.txt"
if [ "${IDLE_S:-120}" != 0 ]; then
echo "== a stage's ops after the rank waited, on the GPU"
timeout "${IDLE_S:-120}" python3 benchmarks/idle_penalty.py --device cuda --models ${IDLE_MODELS:-whisper gpt mlp} \
    --pauses 1 5 10 --repeats 20 2>&1 | grep -v Warning | tee "$out/idle_penalty.txt"
fi
if [ "${CLUSTER_S:-60}" != 0 ]; then
echo "== planner cluster --quick on this machine"
timeout "${CLUSTER_S:-60}" python3 -m planner cluster --quick --out "$out/cluster.json" 2>&1 | tail -6
echo "exit status ${PIPESTATUS[0]}"
fi
if [ "${SPLIT_S:-90}" != 0 ]; then
echo "== the split's tests on this machine's torch and transformers (CPU)"
timeout "${SPLIT_S:-90}" python3 -m pytest -q -p no:cacheprovider tests/runtime/test_custom_functions.py \
    tests/runtime/test_kept_modules.py tests/runtime/test_checkpointed.py tests/runtime/test_opaque_calls.py \
    tests/runtime/test_stages.py 2>&1 | tail -8
fi
if [ "${FAMILIES_S:-240}" != 0 ]; then
echo "== transformers families trained split and plain on the GPU"
timeout "${FAMILIES_S:-240}" python3 benchmarks/model_families.py --device cuda --families "${FAMILIES:-}" 2>/dev/null | tee "$out/families.md"
fi
