"""Two runs compared quantity by quantity, with confidence (`compare`), and the neutral
quantities any engine is judged by (`comparable`): what `profinfer diff` gates with. Engines
and levels add their own quantities. It imports the rooms below it."""
