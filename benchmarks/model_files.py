"""The model files the benchmarks run, by short name (the examples, and transformers models no test uses)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_FILES = {"mlp": REPO / "examples" / "mlp.py", "gpt": REPO / "examples" / "gpt.py",
               "resnet": REPO / "examples" / "resnet.py", "vgg": REPO / "examples" / "vgg.py",
               "llama": REPO / "examples" / "llama.py", "gpt2": REPO / "benchmarks" / "models" / "gpt2.py",
               "gpt2-medium": REPO / "benchmarks" / "models" / "gpt2_medium.py",
               "gpt2-checkpointed": REPO / "benchmarks" / "models" / "gpt2_checkpointed.py",
               "gpt2-frozen": REPO / "benchmarks" / "models" / "gpt2_frozen.py",
               "whisper": REPO / "benchmarks" / "models" / "whisper.py",
               "bert": REPO / "benchmarks" / "models" / "bert.py", "vit": REPO / "benchmarks" / "models" / "vit.py",
               "t5": REPO / "benchmarks" / "models" / "t5.py"}
