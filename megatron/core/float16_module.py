"""Run a model chunk in fp16/bf16 while the rest of the trainer sees fp32 at its edges."""
import torch


class Float16Module(torch.nn.Module):
    """Casts the wrapped module to ``dtype``; float inputs are cast down on the first stage and
    outputs cast back to fp32 on the last stage (losses are then reduced in fp32)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, pre_process: bool = True,
                 post_process: bool = True):
        super().__init__()
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"Float16Module needs fp16 or bf16, got {dtype}")
        self.module = module.to(dtype)
        self.dtype = dtype
        self.pre_process = pre_process
        self.post_process = post_process
        self.config = getattr(module, "config", None)

    def _cast(self, value, dtype):
        if torch.is_tensor(value) and torch.is_floating_point(value):
            return value.to(dtype)
        return value

    def forward(self, *args, **kwargs):
        if self.pre_process:
            args = tuple(self._cast(a, self.dtype) for a in args)
            kwargs = {k: self._cast(v, self.dtype) for k, v in kwargs.items()}
        output = self.module(*args, **kwargs)
        if self.post_process:
            output = self._cast(output, torch.float32)
        return output

    def set_input_tensor(self, tensor):
        return self.module.set_input_tensor(tensor)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
