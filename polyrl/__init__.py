"""PolyRL: RL post-training for agents, multi-agent teams, VLMs and diffusion models.

The import package `polyrl` is a thin root; its parts live in the top-level folders
`core/`, `agents/`, `marl/`, `multimodal/` and `diffusion/` (see pyproject.toml).
"""

__version__ = "0.1.0"
