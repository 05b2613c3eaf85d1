from llamaterm.app.cli import main

if __name__ == "__main__":  # the engine's child process imports this module again (spawn)
    main()
