"""loongforge.embodied: Torch-native FSDP2 stack and VLA/WAM policies (placeholder: filled by a later issue).

What exists so far: `loongforge.embodied.data`, a reader for LeRobot datasets (v2.1, v3.0).
"""
