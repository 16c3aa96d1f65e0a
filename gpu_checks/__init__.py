"""Checks that need an NVIDIA GPU (``bash gpu_checks/gpu_check.sh OUTDIR``): the CUDA tests,
compute-sanitizer over :mod:`gpu_checks.cuda_smoke`, CPU-vs-CUDA agreement
(:mod:`gpu_checks.cpu_cuda_agreement`), the benchmarks, and the static model's prediction next to
the measured times (:mod:`gpu_checks.model_vs_measured`)."""
