"""Long Range Arena tasks (currently ListOps): data generation/loading, training runner, commands."""
