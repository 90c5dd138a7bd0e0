"""Runtime that carries out a pipeline plan: stages from a model, an in-process pipeline, the torchrun engine,
training checkpoints, and the torch.distributed.pipelining route."""

from runtime.checkpoint import CheckpointError, export_checkpoint
from runtime.engine import Engine, EngineError, init_distributed
from runtime.pipeline import Pipeline, PipelineError
from runtime.stages import Stages, StageSplitError, build_stages, split_model

__all__ = ["CheckpointError", "Engine", "EngineError", "Pipeline", "PipelineError", "Stages", "StageSplitError",
           "build_stages", "export_checkpoint", "init_distributed", "split_model"]
