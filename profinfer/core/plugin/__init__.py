"""What an engine or a level is given and what it gives back: probe packs resolved against a
target's libraries (`packs`, `packfinder`), the collector base class with the attach sequence
every collector shares (`collector`), and the contracts of a plug-in's report sections and
tables (`sections`, `tables`), timeline tracks (`timeline`, `timeline_groups`) and commands
(`commands`). It may import every room below it."""
