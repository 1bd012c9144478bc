"""What the keeper tells the training process it forks (environment variables)."""

__all__ = ["ENV_FD", "ENV_INCARNATION", "ENV_MAX", "ENV_ON"]

ENV_ON = "STEADYTRAIN_INPLACE"  # "1": in-place recovery on for this process; "0": off
ENV_INCARNATION = "STEADYTRAIN_INPLACE_INCARNATION"  # 0: the first process; n: n-th replacement
ENV_FD = "STEADYTRAIN_INPLACE_FD"  # a pipe to the keeper: one byte after the first step
ENV_MAX = "STEADYTRAIN_INPLACE_MAX"  # in-place recoveries per rank per torchrun attempt
