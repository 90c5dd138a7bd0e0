"""Runtime that carries out a pipeline plan: stages from a model, an in-process pipeline, and the torchrun engine."""

from runtime.engine import Engine, EngineError, init_distributed
from runtime.pipeline import Pipeline, PipelineError
from runtime.stages import Stages, StageSplitError, build_stages, split_model

__all__ = ["Engine", "EngineError", "Pipeline", "PipelineError", "Stages", "StageSplitError", "build_stages",
           "init_distributed", "split_model"]
