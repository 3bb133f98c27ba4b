"""Launching a recipe on a Ray cluster (`python -m verl_kit.launch.cluster`)."""

