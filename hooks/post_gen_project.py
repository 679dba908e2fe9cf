"""Drop LICENSE when none was chosen, then say what to run next (cwd is the new project)."""
from pathlib import Path

PROJECT = {{ cookiecutter.project | tojson }}

if {{ cookiecutter.license | tojson }} == "none":
    Path("LICENSE").unlink(missing_ok=True)

print(f"""
Generated {PROJECT}. Next steps:

    cd {PROJECT}
    pip install -e .    # or: pip install -r requirements.txt
    python train.py
    python train.py loader=memory-tight
    tensorboard --logdir outputs
""")
