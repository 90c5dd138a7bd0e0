"""Runtime that carries out a pipeline plan: stages from a model, and an in-process pipeline (torchrun engine to come)."""

from runtime.pipeline import Pipeline, PipelineError
from runtime.stages import Stages, StageSplitError, build_stages, split_model

__all__ = ["Pipeline", "PipelineError", "Stages", "StageSplitError", "build_stages", "split_model"]
