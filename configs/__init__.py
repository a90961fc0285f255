"""Config files (`--config=configs/<name>.py[:arg]`), a package so that they import each
other plainly (`from configs import base`) when run from the repository root."""
