"""Profiling-driven pipeline-parallel planner for PyTorch: profile a model, plan its stages."""

from planner.errors import (
    DeviceError, FileFormatError, FileProblemError, ModelFileError, PlannerError, ProfileError,
)
from planner.model_file import load_model_file
from planner.pipedream import import_pipedream
from planner.profile import LayerProfile, Profile, SharedParam, load_profile
from planner.profiler import ProfileSettings, profile_model
from planner.version import __version__

__all__ = [
    "DeviceError", "FileFormatError", "FileProblemError", "LayerProfile", "ModelFileError", "PlannerError",
    "Profile", "ProfileError", "ProfileSettings", "SharedParam", "__version__", "import_pipedream",
    "load_model_file", "load_profile", "profile_model",
]
