"""PolyRL: RL post-training for agents, multi-agent teams, VLMs and diffusion models.

The import package `polyrl` is a thin root; its parts live in the top-level folders
`core/`, `agents/`, `marl/`, `multimodal/` and `diffusion/` (see pyproject.toml).
"""

# The one place the version is written: pyproject.toml reads it (tool.setuptools.dynamic).
__version__ = "0.1.0"
