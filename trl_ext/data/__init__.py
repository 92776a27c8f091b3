"""What goes in: the input checks (TRL's own preparation as the verdict) and vision-language inputs."""
