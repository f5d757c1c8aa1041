"""Floor, custagg per-example norms and tf.vectorized_map norms in ONE process
(one thread), for the loop models: python benchmarks/results/control_flow/inprocess_norms.py gru 32
(run from the repository root with PYTHONPATH=.). Written for docs/control-flow.md."""
import os,sys,time
os.environ["TF_USE_LEGACY_KERAS"]="1"; os.environ["TF_CPP_MIN_LOG_LEVEL"]="3"
import numpy as np, tensorflow as tf
tf.compat.v1.disable_eager_execution()
import custagg
from custagg.per_example.forms import copies as recompute
from benchmarks import models
m=sys.argv[1]; B=int(sys.argv[2])
x,y=models.tf_placeholders(m,B,dynamic=True)  # [None, ...]: recompute refuses a static B
p,vl=models.tf_variables(m)
loss=models.tf_loss(m,p,x,y)
def sq(gs): return tf.add_n([tf.reduce_sum(tf.reshape(tf.square(g),[B,-1]),1) for g in gs])
n_auto=custagg.per_example_norms(loss,vl)
def one(args):
    xi,yi=args
    li=models.tf_loss(m,p,xi[None],yi[None])
    return [tf.convert_to_tensor(g) for g in tf.compat.v1.gradients(tf.reduce_sum(li),vl)]
n_vmap=tf.sqrt(sq(tf.vectorized_map(one,(x,y))))
floor=tf.compat.v1.gradients(tf.reduce_sum(loss),vl)
xv,yv=models.make_batch(m,B)
cfg=tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,inter_op_parallelism_threads=1)
with tf.compat.v1.Session(config=cfg) as s:
    s.run(tf.compat.v1.global_variables_initializer())
    fd={x:xv,y:yv}
    for name,t in [("floor",floor),("auto",n_auto),("vmap",n_vmap)]:
        s.run(t,fd)
        ts=[]
        for _ in range(5):
            t0=time.time(); s.run(t,fd); ts.append(time.time()-t0)
        print(m, B, name, "%.1f ms" % (1000*np.median(ts)))
