"""Built-in agentic examples that train the tiny model on CPU: a calculator tool and a
guess-the-number game (jobspecs/agent_calculator.toml, jobspecs/agent_guess.toml)."""
