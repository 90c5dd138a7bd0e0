"""Profiling-driven pipeline-parallel planner for PyTorch: profile a model, plan its stages."""

from planner.cluster import Cluster, ClusterError, Level, load_cluster, make_cluster
from planner.errors import (
    DeviceError,
    FileFormatError,
    FileProblemError,
    InfeasiblePlanError,
    ModelFileError,
    PlannerError,
    ProfileError,
)
from planner.model_file import load_model_file
from planner.partition import compare_baselines, partition
from planner.pipedream import import_pipedream
from planner.plan import Plan, PlanProfileMismatchError, load_plan
from planner.profile import LayerProfile, Profile, SharedParam, load_profile
from planner.profiler import ProfileSettings, profile_model
from planner.version import __version__

__all__ = [
    "Cluster", "ClusterError", "DeviceError", "FileFormatError", "FileProblemError", "InfeasiblePlanError",
    "LayerProfile", "Level", "ModelFileError", "Plan", "PlanProfileMismatchError", "PlannerError", "Profile",
    "ProfileError", "ProfileSettings", "SharedParam", "__version__", "compare_baselines", "import_pipedream",
    "load_cluster", "load_model_file", "load_plan", "load_profile", "make_cluster", "partition", "profile_model",
]
