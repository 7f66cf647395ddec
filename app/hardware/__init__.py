"""The hardware model: GPU and model catalogs, the roofline iteration latency every
substrate reads (`specs`, calibrated CPU figures in `profiles/`) and the KV transfer
link between engines (`kv_link`). Pure, no I/O beyond reading a profile."""
