"""loongforge.embodied: Torch-native FSDP2 stack and VLA/WAM policies (placeholder: filled by a later issue)."""
