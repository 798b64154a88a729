"""Transfer kernels that move KV pages between device and host pools."""
