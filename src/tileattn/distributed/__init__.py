"""Ring attention across processes on torch.distributed."""
