"""Training the small built-in "tiny-tasks" model (a synthetic task whose answer length the
prompt fixes), so output-length probes have a real signal to read."""
