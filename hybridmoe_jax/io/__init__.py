"""File formats read and written by several packages (numpy + json only): safetensors."""
