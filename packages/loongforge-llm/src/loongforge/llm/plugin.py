"""What loongforge-llm registers: its recipes."""


def register(reg) -> None:
    from loongforge.llm import pretrain

    reg.add("recipe", "llm.pretrain", pretrain.run)
