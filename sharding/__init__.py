"""Meshes and parallel execution of the model step (see README.md)."""
from sharding.mesh import AXES, MeshConfig, make_mesh

__all__ = ["AXES", "MeshConfig", "make_mesh"]
