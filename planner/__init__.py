"""Profiling-driven pipeline-parallel planner for PyTorch: profile a model, plan its stages.

The public API is imported on first use (`planner.partition` loads the planner, not torch), so
`import planner` and the `planner` command start at once.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from planner.version import __version__

_WHERE = {  # public name -> the module that defines it
    "Cluster": "planner.files.cluster", "ClusterError": "planner.files.cluster", "Level": "planner.files.cluster",
    "load_cluster": "planner.files.cluster", "make_cluster": "planner.files.cluster",
    "DeviceError": "planner.errors", "FileFormatError": "planner.errors", "FileProblemError": "planner.errors",
    "InfeasiblePlanError": "planner.errors", "ModelFileError": "planner.errors", "PlannerError": "planner.errors",
    "ProfileError": "planner.errors",
    "load_model_file": "planner.profiling.model_file",
    "compare_baselines": "planner.planning.partition", "partition": "planner.planning.partition",
    "import_pipedream": "planner.files.pipedream",
    "Plan": "planner.files.plan", "PlanProfileMismatchError": "planner.files.plan", "load_plan": "planner.files.plan",
    "LayerProfile": "planner.files.profile", "Profile": "planner.files.profile", "SharedParam": "planner.files.profile",
    "load_profile": "planner.files.profile",
    "ProfileSettings": "planner.profiling.profiler", "profile_model": "planner.profiling.profiler",
    "simulate": "planner.simulation.plan_simulation",
}

__all__ = sorted([*_WHERE, "__version__"])

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` imports on first use
    from planner.errors import (DeviceError, FileFormatError, FileProblemError, InfeasiblePlanError, ModelFileError,
                                PlannerError, ProfileError)
    from planner.files.cluster import Cluster, ClusterError, Level, load_cluster, make_cluster
    from planner.files.pipedream import import_pipedream
    from planner.files.plan import Plan, PlanProfileMismatchError, load_plan
    from planner.files.profile import LayerProfile, Profile, SharedParam, load_profile
    from planner.planning.partition import compare_baselines, partition
    from planner.profiling.model_file import load_model_file
    from planner.profiling.profiler import ProfileSettings, profile_model
    from planner.simulation.plan_simulation import simulate


def __getattr__(name: str) -> Any:
    """`planner.<name>` of the public API, imported from its module on first use."""
    if name not in _WHERE:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
