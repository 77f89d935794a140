"""Pipeline execution: testbed's schedule tables run over stage sub-meshes (MPMD), one SPMD program, or in lockstep."""
