"""What a run is told, read in one place: trl_ext's options in a training config, typed, each with its one default
(``trainer_options``). It imports nothing else of trl_ext's, so every room can read its options here."""
