raise ImportError(
    "recipes/ is not a package: recipes are scripts to copy and edit, run as `python recipes/<name>.py` or under "
    "`accelerate launch`. Shared mechanism lives in verl_kit/."
)
