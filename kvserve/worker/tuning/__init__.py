"""Start-up measurements that choose the kernels each layer runs on this machine."""
